"""flax NNX inside torch (FlaxModule) and torch inside flax NNX (TorchModule)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import torchjax
from torchjax.interop import FlaxModule, TorchModule


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.block = FlaxModule(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.block(self.inp(x))))


def test_flax_submodule_parameters_are_torch_parameters_and_train():
    torch.manual_seed(0)
    net = Net().to("tpu")
    names = [n for n, _ in net.named_parameters()]
    assert "block.kernel" in names and "block.bias" in names
    kernel_before = net.block.kernel.detach().clone()
    x, y = torch.randn(16, 4, device="tpu"), torch.randn(16, 1, device="tpu")
    # gradients equal those of the same computation in pure JAX
    loss = (net(x) - y).square().mean()
    loss.backward()

    def pure(kernel, bias):
        h = jnp.tanh((x.jax() @ net.inp.weight.jax().T + net.inp.bias.jax()) @ kernel + bias)
        return jnp.mean((h @ net.out.weight.jax().T + net.out.bias.jax() - y.jax()) ** 2)

    gk, gb = jax.grad(pure, argnums=(0, 1))(net.block.kernel.jax(), net.block.bias.jax())
    np.testing.assert_allclose(
        net.block.kernel.grad.cpu().numpy(), np.asarray(gk), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        net.block.bias.grad.cpu().numpy(), np.asarray(gb), rtol=1e-5, atol=1e-6
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = (net(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(net.block.kernel.cpu(), kernel_before.cpu())
    trained = net.block.to_nnx()
    np.testing.assert_allclose(
        np.asarray(trained.kernel.value), net.block.kernel.detach().cpu().numpy()
    )


def test_torch_submodule_inside_flax_trains_with_nnx_optimizer():
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()).to("tpu")

    class Model(nnx.Module):
        def __init__(self):
            self.body = TorchModule(body)
            self.head = nnx.Linear(8, 1, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.head(self.body(x))

    model = Model()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((16, 1)), jnp.float32)
    want = body(torchjax.from_jax(x)).jax()
    np.testing.assert_allclose(np.asarray(model.body(x)), np.asarray(want), rtol=1e-6)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(15)]
    assert losses[-1] < losses[0]
