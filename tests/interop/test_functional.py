"""torchjax.functional: a torch module as a pure JAX function (jit, grad, vmap), and
training it with optax."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torchjax


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )  # fmt: skip


def data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


def test_params_are_the_module_arrays_and_tied_weights_appear_once():
    m = mlp().to("tpu")
    params, _ = torchjax.functional(m)
    assert list(params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert params["0.weight"] is m[0].weight.jax()

    emb = torch.nn.Embedding(5, 4)
    tied = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(4, 5, bias=False)})
    tied.head.weight = emb.weight
    tied.to("tpu")
    params, _ = torchjax.functional(tied)
    assert list(params) == ["emb.weight"]


def test_jit_grad_and_value_and_grad_match_torch_autograd():
    cpu = mlp()
    params, apply = torchjax.functional(copy.deepcopy(cpu).to("tpu"))
    x, y = data()

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
    want = torch.nn.functional.cross_entropy(cpu(torch.tensor(x)), torch.tensor(y))
    want.backward()
    np.testing.assert_allclose(float(value), want.item(), rtol=1e-6)
    for name, p in cpu.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_per_example_gradients_with_vmap_of_grad():
    cpu = mlp()
    params, apply = torchjax.functional(copy.deepcopy(cpu).to("tpu"))
    x, y = data(4)

    def loss(p, xi, yi):
        logits = apply(p, xi[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, x, y)
    for i in range(4):
        cpu.zero_grad()
        torch.nn.functional.cross_entropy(
            cpu(torch.tensor(x[i : i + 1])), torch.tensor(y[i : i + 1])
        ).backward()
        for name, p in cpu.named_parameters():
            np.testing.assert_allclose(
                np.asarray(per_example[name][i]), p.grad.numpy(), rtol=1e-5, atol=1e-6
            )


def test_buffers_are_included_and_mutable_returns_written_state():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(6).to("tpu")
    params, apply = torchjax.functional(bn, mutable=True)
    assert set(params) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    x, _ = data()
    out, written = jax.jit(apply)(params, x)
    assert set(written) == {"running_mean", "running_var", "num_batches_tracked"}
    assert bn.num_batches_tracked.item() == 0  # the module itself is untouched
    ref = torch.nn.BatchNorm1d(6)
    want = ref(torch.tensor(x))
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(written["running_mean"]), ref.running_mean.numpy(), rtol=1e-5, atol=1e-6
    )


def test_random_ops_use_the_given_key():
    drop = torch.nn.Dropout(0.5).to("tpu")
    params, apply = torchjax.functional(drop)
    f = jax.jit(lambda key: apply(params, jnp.ones(64), key=key))
    a, b = f(jax.random.key(0)), f(jax.random.key(1))
    assert not np.array_equal(a, b) and np.array_equal(a, f(jax.random.key(0)))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="move the module with .to\\('tpu'\\)"):
        torchjax.functional(mlp())


def test_optax_training_matches_torch_optim_adamw():
    cpu = mlp()
    params, apply = torchjax.functional(copy.deepcopy(cpu).to("tpu"))
    x, y = data(32)
    tx = optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    opt = torch.optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for _ in range(15):
        params, state, value = step(params, state)
        loss = torch.nn.functional.cross_entropy(cpu(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(value))
        np.testing.assert_allclose(float(value), loss.item(), rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]
    for name, p in cpu.named_parameters():
        np.testing.assert_allclose(
            np.asarray(params[name]), p.detach().numpy(), rtol=1e-3, atol=1e-4
        )
