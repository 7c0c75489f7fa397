"""torchjax.jax_function: JAX functions inside PyTorch code, differentiable."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import torchjax


@torchjax.jax_function
def jax_attention(q, k, v, *, causal):
    # (batch, seq, heads, dim) layout, as jax.nn.dot_product_attention takes it
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


class JaxAttentionModel(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, use_jax=True):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if use_jax:
            o = jax_attention(q, k, v, causal=True)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        return self.out(o.reshape(b, s, d))


def test_model_with_jax_attention_matches_torch_sdpa_forward_and_grads():
    torch.manual_seed(0)
    model = JaxAttentionModel().to("tpu")
    x = torch.randn(2, 5, 16, device="tpu", requires_grad=True)
    ref = JaxAttentionModel()
    ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    xc = x.detach().cpu().requires_grad_()
    out, want = model(x), ref(xc, use_jax=False)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_gradient_equals_pure_jax():
    def f(a, b):
        return {"y": jnp.sin(a) * b, "n": jnp.sum(a > 0)}

    tf = torchjax.jax_function(f)
    a = torch.randn(4, device="tpu", requires_grad=True)
    b = torch.randn(4, device="tpu", requires_grad=True)
    out = tf(a, b)
    assert out["n"].dtype == torch.int32 or out["n"].dtype == torch.int64
    assert not out["n"].requires_grad
    out["y"].sum().backward()
    ga, gb = jax.grad(lambda a, b: f(a, b)["y"].sum(), argnums=(0, 1))(a.jax(), b.jax())
    torch.testing.assert_close(a.grad, torchjax.from_jax(ga))
    torch.testing.assert_close(b.grad, torchjax.from_jax(gb))


def test_no_grad_calls_skip_the_vjp_and_eager_mode_works():
    tf = torchjax.jax_function(jit=False)(lambda x: x * 2)
    x = torch.ones(3, device="tpu")
    assert tf(x).tolist() == [2.0, 2.0, 2.0]
    with torch.no_grad():
        y = tf(x.requires_grad_())
    assert y.grad_fn is None


def test_inside_torchjax_jit_and_torch_compile():
    torch.manual_seed(0)
    model = JaxAttentionModel().to("tpu")
    x = torch.randn(2, 5, 16, device="tpu")
    with torch.no_grad():
        want = model(x, use_jax=False)
        got = torchjax.jit(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tpu")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, want, rtol=1e-5, atol=1e-5)

    step_model = JaxAttentionModel().to("tpu")
    opt = torch.optim.SGD(step_model.parameters(), lr=0.1)

    @torchjax.jit
    def step(x):
        loss = step_model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses = [step(x).item() for _ in range(4)]
    assert losses[-1] < losses[0]


def test_non_hashable_static_arguments_are_an_error_under_jit():
    import numpy as np

    tf = torchjax.jax_function(lambda x, scale: x * scale)
    with pytest.raises(TypeError, match="must be hashable under jit=True, got ndarray"):
        tf(torch.ones(2, device="tpu"), np.ones(2))
    assert tf(torch.ones(2, device="tpu"), 3.0).tolist() == [3.0, 3.0]


def test_complex_gradients_follow_torchs_convention():
    # They came back conjugated (JAX's VJP convention, not torch's).
    z = torch.randn(4, dtype=torch.complex64)
    zc = z.clone().requires_grad_()
    (zc**3 * 2).real.sum().backward()
    zt = z.to("tpu").requires_grad_()
    torchjax.jax_function(lambda a: a**3 * 2)(zt).real.sum().backward()
    torch.testing.assert_close(zt.grad.cpu(), zc.grad, atol=1e-5, rtol=1e-5)
