"""Ragged dot (grouped matmul): the Pallas kernels (interpret mode) against
jax.lax.ragged_dot and CPU torch, forward and gradients; the Tokamax wrappers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.pallas.tolerance import F32_VS_CPU
from torchjax import pallas as tp
from torchjax.pallas import _ragged, _tiling, kernels

_RNG = np.random.default_rng(0)
M, K, N = 20, 16, 8
SIZES = [5, 0, 9, 3]  # an empty group, and 3 rows past the last group (zeros)


def _arrays(transpose_rhs):
    lhs = jnp.asarray(_RNG.standard_normal((M, K)), jnp.float32)
    shape = (len(SIZES), N, K) if transpose_rhs else (len(SIZES), K, N)
    rhs = jnp.asarray(_RNG.standard_normal(shape), jnp.float32)
    ct = jnp.asarray(_RNG.standard_normal((M, N)), jnp.float32)
    return lhs, rhs, jnp.asarray(SIZES, jnp.int32), ct


@pytest.mark.parametrize(
    "transpose_rhs, blocks, platform",
    [
        (False, None, "interpret"),
        (True, None, "interpret"),
        (False, (8, 8, 8), "interpret"),  # 3 row tiles, 2 k tiles: the visit schedule
        (True, (8, 8, 8), "gpu"),  # the loop form Triton compiles, run in interpret mode
    ],
    ids=["gkn", "gnk", "gkn-tiled", "gnk-gpu-form"],
)
def test_kernel_matches_lax_ragged_dot_forward_and_grad(
    transpose_rhs, blocks, platform, monkeypatch
):
    monkeypatch.setattr(_tiling, "platform", lambda interpret: platform)
    lhs, rhs, sizes, ct = _arrays(transpose_rhs)

    def run(fn, **kw):
        def loss(a, b):
            out = fn(a, b, sizes, transpose_rhs=transpose_rhs, **kw)
            return jnp.sum(out * ct), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)

    (_, out), grads = run(kernels.ragged_dot, blocks=blocks, interpret=True)
    (_, ref), ref_grads = run(kernels.ragged_dot_reference)
    assert jnp.allclose(out, ref, atol=1e-5)
    assert not jnp.any(out[sum(SIZES) :])
    for g, r in zip(grads, ref_grads):
        assert jnp.allclose(g, r, atol=1e-5)


_SCHEDULE = jax.jit(_ragged.schedule, static_argnums=(1, 2))


@pytest.mark.parametrize("sizes", [[5, 0, 9, 3], [0, 0, 20, 0], [8, 8, 0, 0], [1, 1, 1, 1]])
def test_schedule_visits_every_row_tile_and_group(sizes):
    # Note [Ragged dot visit schedule]: within tiles_m + G - 1 visits, every (row tile,
    # group) pair that shares a row is visited once, in order, and every row tile once
    # at least.
    offsets, tiles, groups, firsts, valids, group_firsts = map(
        np.asarray, _SCHEDULE(jnp.asarray(sizes, jnp.int32), 3, 8)
    )
    pairs = [(int(t), int(g)) for t, g, v in zip(tiles, groups, valids) if v]
    assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)
    rows = {(r // 8, g) for g in range(4) for r in range(offsets[g], offsets[g + 1])}
    assert rows <= set(pairs)
    assert {t for t, _ in pairs} == {0, 1, 2}
    assert [t for t, g in pairs if firsts[pairs.index((t, g))]] == [0, 1, 2]


def test_long_ragged_dot_matches_reference_with_grads():
    # M = 4096 rows over 8 experts at the default interpret blocks: 16 row tiles.
    m, k, n, g = 4096, 32, 32, 8
    sizes = jnp.asarray(np.bincount(_RNG.integers(0, g, m - 100), minlength=g), jnp.int32)
    lhs = jnp.asarray(_RNG.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(_RNG.standard_normal((g, k, n)), jnp.float32)

    def run(fn):
        loss = lambda a, b: jnp.sum(fn(a, b, sizes) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)

    (out, grads), (ref, ref_grads) = run(kernels.ragged_dot), run(kernels.ragged_dot_reference)
    assert jnp.allclose(out, ref, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-3), float(jnp.abs(a - b).max())


def _torch_reference(lhs, rhs, sizes):
    """Per-group F.linear on CPU torch (rhs in (G, N, K) layout)."""
    out, start = torch.zeros(lhs.shape[0], rhs.shape[1]), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = F.linear(lhs[start : start + n], rhs[g])
        start += n
    return out


def test_torch_op_matches_cpu_with_grads():
    torch.manual_seed(0)
    lhs, rhs = torch.randn(M, K), torch.randn(len(SIZES), N, K)
    cpu = [lhs.clone().requires_grad_(), rhs.clone().requires_grad_()]
    tpu = [lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()]
    ref = _torch_reference(*cpu, SIZES)
    out = tp.ragged_dot(*tpu, torch.tensor(SIZES, device="tpu"), True)
    torch.testing.assert_close(out.cpu(), ref.detach())
    ct = torch.randn(M, N)
    (ref * ct).sum().backward()
    (out * ct.to("tpu")).sum().backward()
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad)


def test_tokamax_ragged_dot_matches_cpu_with_grads():
    torch.manual_seed(1)
    lhs, rhs = torch.randn(M, K), torch.randn(len(SIZES), K, N)
    cpu = [lhs.clone().requires_grad_(), rhs.clone().requires_grad_()]
    tpu = [lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()]
    ref = _torch_reference(cpu[0], cpu[1].transpose(1, 2), SIZES)
    out = tp.tokamax_ragged_dot(*tpu, torch.tensor(SIZES, device="tpu"))
    torch.testing.assert_close(out.cpu(), ref.detach())
    ref.sum().backward()
    out.sum().backward()
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad)


def test_tokamax_attention_matches_cpu_sdpa_with_grads():
    torch.manual_seed(2)
    # 128 positions and 128 dims: tokamax's TPU kernel takes 128-wide blocks.
    shapes = [(1, 4, 128, 128), (1, 2, 128, 128), (1, 2, 128, 128)]
    cpu = [torch.randn(s).requires_grad_() for s in shapes]
    tpu = [x.detach().to("tpu").requires_grad_() for x in cpu]
    ref = F.scaled_dot_product_attention(*cpu, is_causal=True, enable_gqa=True)
    out = tp.tokamax_attention(*tpu, causal=True)
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=1e-4, rtol=1e-4)
    ref.pow(2).sum().backward()
    out.pow(2).sum().backward()
    # Against each gradient's scale, as the flash kernel's (Note [Kernel float32
    # tolerances]): on a v5e tokamax's were 6.9e-5 of it (0.00069 on a scale of 10).
    for t, c in zip(tpu, cpu):
        scale = c.grad.abs().max()
        torch.testing.assert_close(t.grad.cpu() / scale, c.grad / scale, **F32_VS_CPU)


def test_kernel_bfloat16_accumulates_in_float32():
    lhs, rhs, sizes, _ = _arrays(False)
    out = jax.jit(kernels.ragged_dot)(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes)
    assert out.dtype == jnp.bfloat16
    ref = kernels.ragged_dot_reference(lhs, rhs, sizes)
    assert jnp.allclose(out.astype(jnp.float32), ref, atol=0.1, rtol=2e-2)


# The platforms whose float64 form runs here: a backend with a form of its own has no
# float64 lax.ragged_dot to run another platform's with (Note [float64 ragged dot]).
_FLOAT64_PLATFORMS = [
    p
    for p in ("cpu", "tpu")
    if p == jax.default_backend() or jax.default_backend() not in _ragged.FLOAT64_FORMS
]


@pytest.mark.parametrize("platform", _FLOAT64_PLATFORMS)
def test_float64_runs_xlas_ragged_dot_with_grads_and_other_dtypes_are_refused(
    platform, monkeypatch
):
    # The kernels trace in 32-bit mode and have no float64 products: float64 failed in
    # the kernel ("Invalid dtype for swap"). Each platform's float64 form runs here
    # (Note [float64 ragged dot]): XLA's ragged_dot, and TPU's product per group.
    form = _ragged.FLOAT64_FORMS.get(platform, _ragged.ragged_dot_reference)
    calls = []
    spy = lambda *a, **k: calls.append(1) or form(*a, **k)  # noqa: E731
    monkeypatch.setattr(_ragged, "FLOAT64_FORMS", {jax.default_backend(): spy})
    jax.clear_caches()  # the form is chosen at trace time: trace anew
    torch.manual_seed(3)
    lhs, rhs = torch.randn(8, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    sizes = torch.tensor([3, 4])
    cpu = [lhs.clone().requires_grad_(), rhs.clone().requires_grad_()]
    tpu = [lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()]
    want = torch.cat([cpu[0][:3] @ cpu[1][0], cpu[0][3:7] @ cpu[1][1], cpu[0][7:] * 0 @ cpu[1][1]])
    got = tp.ragged_dot(*tpu, sizes.to("tpu"))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want.detach())
    assert calls, "the platform's float64 form did not run"
    want.sum().backward()
    got.sum().backward()
    for t, c in zip(tpu, cpu):
        assert t.grad.dtype == torch.float64
        torch.testing.assert_close(t.grad.cpu(), c.grad)
    with pytest.raises(ValueError, match="the kernels take float32, bfloat16 or float16"):
        tp.ragged_dot(lhs.long().to("tpu"), rhs.long().to("tpu"), sizes.to("tpu"))


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["gkn", "gnk"])
def test_xlas_parts_compose_with_the_kernels_in_half_precision(transpose_rhs, monkeypatch):
    # The TPU row of Note [Ragged dot parts by platform], run in interpret mode: XLA's
    # forward and drhs beside the Pallas dlhs give the all-Pallas values and gradients.
    lhs, rhs, sizes, ct = _arrays(transpose_rhs)
    lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    calls = []
    real_fwd, real_drhs = _ragged._xla_fwd, _ragged._xla_drhs
    monkeypatch.setattr(_ragged, "_xla_fwd", lambda *a: calls.append("fwd") or real_fwd(*a))
    monkeypatch.setattr(_ragged, "_xla_drhs", lambda *a: calls.append("drhs") or real_drhs(*a))

    def run():
        def loss(a, b):
            out = kernels.ragged_dot(a, b, sizes, transpose_rhs=transpose_rhs, interpret=True)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)

    (_, want), want_grads = run()
    assert not calls
    monkeypatch.setitem(_ragged.XLA_PARTS, "interpret", _ragged.XLA_PARTS["tpu"])
    (_, got), got_grads = run()
    assert sorted(calls) == ["drhs", "fwd"], calls
    assert got.dtype == want.dtype == jnp.bfloat16
    assert not jnp.any(got[sum(SIZES) :])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert jnp.allclose(f32(got), f32(want), atol=0.05, rtol=2e-2)
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert jnp.allclose(f32(g), f32(w), atol=0.1, rtol=2e-2)
    # float32 keeps the kernels in every part
    calls.clear()
    kernels.ragged_dot(f32(lhs), f32(rhs), sizes, transpose_rhs=transpose_rhs, interpret=True)
    assert not calls


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["gkn", "gnk"])
def test_rows_past_the_groups_stay_zero_under_xlas_parts(transpose_rhs, monkeypatch):
    # Note [Rows past the groups under XLA's ragged dot]: on TPU lax.ragged_dot leaves the
    # rows past sum(group_sizes) as memory held them. Here its forward fills them with
    # 7s and its drhs would read them (the cotangent past the groups is nonzero): the
    # op's output there is 0 and its gradients are the all-Pallas ones.
    lhs, rhs, sizes, ct = _arrays(transpose_rhs)
    lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    real = jax.lax.ragged_dot

    def leaves_rows(lhs, rhs, group_sizes, **kw):
        out = real(lhs, rhs, group_sizes, **kw)
        rows = jnp.arange(out.shape[0])[:, None]
        return jnp.where(rows < jnp.sum(group_sizes), out, jnp.asarray(7, out.dtype))

    def run():
        def loss(a, b):
            out = kernels.ragged_dot(a, b, sizes, transpose_rhs=transpose_rhs, interpret=True)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)

    (_, want), want_grads = run()  # every part a Pallas kernel
    monkeypatch.setattr(_ragged.lax, "ragged_dot", leaves_rows)
    monkeypatch.setitem(_ragged.XLA_PARTS, "interpret", _ragged.XLA_PARTS["tpu"])
    (_, got), got_grads = run()
    assert np.any(np.asarray(ct)[sum(SIZES) :])  # a cotangent past the groups to ignore
    assert not jnp.any(got[sum(SIZES) :])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert jnp.allclose(f32(got), f32(want), atol=0.05, rtol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert jnp.allclose(f32(g), f32(w), atol=0.1, rtol=2e-2)
