"""Flash attention: the Pallas kernel (interpret mode) against the jnp reference and CPU
torch, forward and gradients; the SDPA dispatch rule and its switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchjax
from tests.pallas.tolerance import F32_VS_CPU, F32_VS_REFERENCE_ATOL
from torchjax import pallas as tp
from torchjax.pallas import _flash, _sdpa, kernels

B, HQ, HKV, D = 1, 2, 1, 16


# numpy inputs: jax.random would compile a sampler per shape, seconds on a busy CPU.
_RNG = np.random.default_rng(0)


def _qkv(sq, sk, dtype=jnp.float32):
    shapes = [(B, HQ, sq, D), (B, HKV, sk, D), (B, HKV, sk, D)]
    return [jnp.asarray(_RNG.standard_normal(s), dtype) for s in shapes]


def _mask(sq, sk):
    m = _RNG.random((1, HQ, sq, sk)) < 0.7  # per query head: the dk/dv kernel's head blocks
    m[:, :, 5] = False  # a fully masked row: zeros, as torch
    return jnp.asarray(m)


@pytest.mark.parametrize(
    "sq, sk, causal, masked",
    [(32, 32, False, True), (16, 32, True, False)],
    ids=["gqa-bool-mask", "gqa-causal-sq<sk"],
)
def test_kernel_matches_reference_forward_and_grad(sq, sk, causal, masked):
    q, k, v = _qkv(sq, sk)
    mask = _mask(sq, sk) if masked else None
    ct = jnp.asarray(_RNG.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, mask, causal=causal) * ct)

    flash = lambda *a, **kw: kernels.flash_attention(*a, block_q=16, block_k=16, **kw)  # noqa: E731
    # jitted: interpret mode then runs as one XLA program instead of op by op
    out, grads = jax.jit(jax.value_and_grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    ref, ref_grads = jax.jit(
        jax.value_and_grad(loss(kernels.attention_reference), argnums=(0, 1, 2))
    )(q, k, v)
    assert jnp.allclose(out, ref, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        assert jnp.allclose(g, r, atol=F32_VS_REFERENCE_ATOL), float(jnp.abs(g - r).max())


def test_kernel_bfloat16_accumulates_in_float32():
    q, k, v = _qkv(32, 32)

    def run(fn, *args):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a, causal=True)), (0, 1, 2)))(
            *args
        )

    out, grads = run(kernels.flash_attention, *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    ref, ref_grads = run(kernels.attention_reference, q, k, v)
    assert grads[0].dtype == jnp.bfloat16
    assert jnp.allclose(out, ref, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        assert jnp.allclose(g.astype(jnp.float32), r, atol=5e-2, rtol=5e-2)


def test_a_boolean_mask_becomes_additive_without_float64():
    # torchjax traces with JAX's x64 on: 0.0 and -inf as Python floats made the select a
    # float64 (B, H, Sq, Sk) array, converted to bfloat16 after, at every masked call.
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(lambda m: _flash.additive_mask(m, jnp.bfloat16))(_mask(16, 32))
        out = jax.eval_shape(lambda m: _flash.additive_mask(m, jnp.bfloat16), _mask(16, 32))
    dtypes = {v.aval.dtype for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars}
    assert jnp.dtype(jnp.float64) not in dtypes and out.dtype == jnp.bfloat16
    added = _flash.additive_mask(jnp.asarray([[True, False]]), jnp.bfloat16)
    assert added.tolist() == [[[[0.0, -np.inf]]]]


def test_kernel_rejects_ragged_blocks():
    q, k, v = _qkv(24, 24)
    with pytest.raises(ValueError, match="multiples of block_q=16"):
        kernels.flash_attention(q, k, v, block_q=16, block_k=16)


def _torch_qkv(dtype=torch.float32):
    torch.manual_seed(0)
    return (
        torch.randn(1, 4, 32, 32, dtype=dtype),
        torch.randn(1, 2, 32, 32, dtype=dtype),
        torch.randn(1, 2, 32, 32, dtype=dtype),
    )


def _uses_kernel(out) -> bool:
    return "flash_attention" in type(out.grad_fn).__name__


def test_sdpa_uses_kernel_and_matches_cpu_with_grads():
    q, k, v = _torch_qkv()
    cpu = [x.clone().requires_grad_() for x in (q, k, v)]
    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*cpu, is_causal=True, enable_gqa=True)
    with tp.use_flash_attention(True):
        out = F.scaled_dot_product_attention(*tpu, is_causal=True, enable_gqa=True)
    assert _uses_kernel(out)
    torch.testing.assert_close(out.cpu(), ref.detach(), **F32_VS_CPU)
    ct = torch.randn(ref.shape)
    (ref * ct).sum().backward()
    (out * ct.to("tpu")).sum().backward()
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad, **F32_VS_CPU)


def test_sdpa_bfloat16_float_mask_matches_cpu():
    q, k, v = _torch_qkv(torch.bfloat16)
    mask = torch.randn(32, 32, dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    with tp.use_flash_attention(True):
        out = F.scaled_dot_product_attention(
            *(x.to("tpu") for x in (q, k, v, mask)), enable_gqa=True
        )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=2e-2)


def test_sdpa_switch_and_env_var(monkeypatch):
    q, k, v = (x.to("tpu").requires_grad_() for x in _torch_qkv())
    monkeypatch.setenv(tp.FLASH_ATTENTION_ENV_VAR, "1")
    assert _uses_kernel(F.scaled_dot_product_attention(q, q, q))
    with tp.use_flash_attention(False):  # the switch wins over the env var
        assert not _uses_kernel(F.scaled_dot_product_attention(q, q, q))
    with torch.inference_mode():  # no Autograd keys: the registry handler decides
        calls = []
        monkeypatch.setattr(_sdpa, "flash_attention", lambda *a, **k: calls.append(1) or q)
        F.scaled_dot_product_attention(q, q, q)
        assert calls == [1]
    monkeypatch.setenv(tp.FLASH_ATTENTION_ENV_VAR, "0")
    assert not tp.flash_enabled()
    monkeypatch.setenv(tp.FLASH_ATTENTION_ENV_VAR, "auto")
    assert tp.flash_enabled() == (jax.default_backend() in ("tpu", "gpu"))


def test_sdpa_kernel_under_torchjax_jit_and_torch_compile(monkeypatch):
    q, k, v = _torch_qkv()
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    calls, flash = [], _sdpa.flash_attention
    monkeypatch.setattr(
        _sdpa, "flash_attention", lambda *a, **kw: calls.append(1) or flash(*a, **kw)
    )

    def attend(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, enable_gqa=True)

    with tp.use_flash_attention(True):
        out = torchjax.jit(attend)(*(x.to("tpu") for x in (q, k, v)))
        compiled = torch.compile(attend, backend="tpu")(*(x.to("tpu") for x in (q, k, v)))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 3  # the jit trace; Dynamo's fake pass and the backend's trace


@pytest.mark.parametrize(
    "kwargs, applies",
    [
        ({}, True),
        ({"dropout_p": 0.1}, False),
        ({"enable_gqa": False}, False),  # Hq != Hkv needs enable_gqa
        ({"attn_mask": torch.ones(32, 32, dtype=torch.bool)}, True),
        ({"attn_mask": torch.ones(32, 32, dtype=torch.bool), "is_causal": True}, False),
        ({"attn_mask": torch.ones(2, 32, 32)}, False),  # leading dim neither 1 nor Hq
        ({"q_len": 24}, False),  # not a multiple of 16
        ({"head_dim": 24}, False),  # not a power of two
    ],
)
def test_dispatch_rule(kwargs, applies):
    kwargs = dict(kwargs)
    s, d = kwargs.pop("q_len", 32), kwargs.pop("head_dim", 32)
    kwargs.setdefault("enable_gqa", True)
    q, k = torch.empty(1, 4, s, d), torch.empty(1, 2, 32, d)
    assert tp.flash_applies(q, k, k, **kwargs) is applies


@pytest.mark.parametrize("sq, causal", [(32, False), (16, True)], ids=["bool-mask", "causal-sq<sk"])
def test_gpu_form_matches_reference_forward_and_grad(sq, causal):
    # The loop form Triton compiles (Note [Kernel platforms]), run in interpret mode.
    q, k, v = _qkv(sq, 32)
    mask = None if causal else _flash.additive_mask(_mask(sq, 32))
    ct = jnp.asarray(_RNG.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2)))

    blocks = (16, 16, 16, 16)
    gpu = loss(lambda *a: _flash._flash(*a, mask, causal, 0.25, blocks, True, "gpu"))
    ref = loss(lambda *a: kernels.attention_reference(*a, mask, causal=causal, scale=0.25))
    (out, grads), (expected, ref_grads) = gpu(q, k, v), ref(q, k, v)
    assert jnp.allclose(out, expected, rtol=1e-5), (out, expected)
    for g, r in zip(grads, ref_grads):
        assert jnp.allclose(g, r, atol=F32_VS_REFERENCE_ATOL), float(jnp.abs(g - r).max())


def test_long_sequence_matches_cpu_torch_with_grads():
    # Sk = 4096: several key and query blocks at the default interpret blocks (512),
    # causal skipping on; against CPU torch, values and gradients.
    s, d = 4096, 16
    q, k, v = (_RNG.standard_normal((1, 1, s, d)).astype(np.float32) for _ in range(3))
    ct = _RNG.standard_normal((1, 1, s, d)).astype(np.float32)
    fn = jax.jit(
        jax.value_and_grad(
            lambda *a: jnp.sum(kernels.flash_attention(*a, causal=True) * ct), argnums=(0, 1, 2)
        )
    )
    loss, grads = fn(q, k, v)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    ref = (F.scaled_dot_product_attention(tq, tk, tv, is_causal=True) * torch.from_numpy(ct)).sum()
    ref.backward()
    assert abs(float(loss) - ref.item()) < 1e-2 * max(1.0, abs(ref.item()))
    for g, t in zip(grads, (tq, tk, tv)):
        torch.testing.assert_close(torch.tensor(np.asarray(g)), t.grad, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_sdpa_with_a_mask_trains_through_the_kernel(mask_dtype):
    # The op's optional mask was passed to its jitted forward as a static argument, a torch
    # tensor JAX refused: every masked SDPA needing a gradient crashed on the kernel path.
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    mask = torch.rand(1, 1, 32, 32) < 0.8
    if mask_dtype == torch.float32:
        mask = torch.zeros(1, 1, 32, 32).masked_fill(~mask, float("-inf"))
    cpu = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*cpu, attn_mask=mask).sum().backward()
    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    with tp.use_flash_attention(True):
        out = F.scaled_dot_product_attention(*tpu, attn_mask=mask.to("tpu"))
    out.sum().backward()
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad, **F32_VS_CPU)


class _LogOff:
    """jax.numpy with a ``log`` 1e-5 relative off: a platform's approximate ``log``."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def log(x):
        return jnp.log(x) * (1 + 1e-5)


@pytest.mark.parametrize("plat", ["tpu", "gpu"])
def test_gradients_do_not_carry_the_platforms_log_error(plat, monkeypatch):
    # Note [Flash residuals]: with a log-sum-exp residual a log 6e-6 off moved these
    # gradients from 8e-7 to 1e-5 of their scale; from the shift and 1/sum they stay at
    # float32's own error against float64, as XLA's softmax.
    from torchjax.pallas import _flash_bwd, _flash_fwd

    for module in (_flash_fwd, _flash_bwd):
        monkeypatch.setattr(module, "jnp", _LogOff())
    g = np.random.default_rng(1)
    q, k, v = (g.standard_normal((1, 4, 128, 32)) for _ in range(3))
    ct = g.standard_normal(q.shape)
    blocks = (32, 32, 32, 32)
    fn = lambda *a: _flash._flash(*a, None, True, 32**-0.5, blocks, True, plat)  # noqa: E731
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    _, pullback = jax.vjp(fn, *f32)
    grads = pullback(jnp.asarray(ct, jnp.float32))
    t64 = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*t64, is_causal=True).backward(torch.from_numpy(ct))
    for got, want in zip(grads, (t.grad.numpy() for t in t64)):
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < 3e-6, err
