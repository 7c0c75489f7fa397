"""Every Pallas kernel compiled by Mosaic under torchjax's x64 setting, against CPU torch:
flash attention forward and backward (causal, masks, GQA) through the default SDPA path,
decode attention (contiguous and paged), the ragged dot forward and backward, a user's
kernel through ``torchjax.pallas.op`` (eager, ``torchjax.jit``, ``torch.compile``
training), and tokamax's TPU kernels.

Tolerances: float32 kernels contract at full precision (Note [Kernel matmul precision])
but sum in another order than CPU's and take the chip's ``exp``: the platform table of
Note [Kernel float32 tolerances] (tests/pallas/tolerance.py); bfloat16 kernels against
CPU float32 on the same bfloat16 inputs, the rounding of bfloat16 outputs (2e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchjax
from tests.pallas import user_kernel
from tests.pallas.tolerance import F32_VS_CPU
from torchjax import pallas as tp
from torchjax.pallas import _sdpa

F32_TOL = F32_VS_CPU
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _spy(monkeypatch):
    # Which kernel SDPA took: the flash and decode entries of the default SDPA path.
    calls = []
    for name in ("flash_attention", "decode_sdpa"):
        fn = getattr(_sdpa, name)
        monkeypatch.setattr(
            _sdpa, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k)
        )
    return calls


ATTENTION_CASES = {
    # (B, Hq, Hkv, Sq, Sk, D), causal, mask: several 512-blocks, GQA groups of 2 and 4.
    "causal-gqa": ((1, 8, 2, 1024, 1024, 128), True, None),
    "bool-mask": ((2, 4, 4, 512, 768, 64), False, "bool"),
    "padding-float-mask-gqa": ((2, 8, 4, 256, 256, 128), False, "float"),
}


def _attention_inputs(b, hq, hkv, sq, sk, d, mask_kind):
    q, k, v = (
        _randn(b, hq, sq, d, seed=1),
        _randn(b, hkv, sk, d, seed=2),
        _randn(b, hkv, sk, d, seed=3),
    )
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(4)) < 0.8
        mask[:, :, 7] = False  # a row with every key masked: zeros, as CPU
    elif mask_kind == "float":  # left padding of 0 and 40 keys, as an additive mask
        mask = torch.zeros(b, 1, sq, sk)
        mask[1, :, :, :40] = float("-inf")
    return q, k, v, mask


@pytest.mark.parametrize(
    "case, dtype",
    [(case, torch.float32) for case in ATTENTION_CASES] + [("causal-gqa", torch.bfloat16)],
    ids=[f"{case}-f32" for case in ATTENTION_CASES] + ["causal-gqa-bf16"],
)
def test_sdpa_takes_the_flash_kernel_forward_and_backward(case, dtype, monkeypatch):
    shape, causal, mask_kind = ATTENTION_CASES[case]
    q, k, v, mask = _attention_inputs(*shape, mask_kind)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    cpu = [x.float().clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*cpu, attn_mask=mask, is_causal=causal, enable_gqa=True)
    ct = _randn(*want.shape, seed=5)
    want.backward(ct)
    want_all = [want.detach()] + [c.grad for c in cpu]
    tmask = None if mask is None else mask.to("tpu")

    def run():
        tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(
            *tpu, attn_mask=tmask, is_causal=causal, enable_gqa=True
        )
        out.backward(ct.to(dtype).to("tpu"))
        return [out] + [t.grad for t in tpu]

    calls = _spy(monkeypatch)
    got = run()  # the defaults: no switch, no environment variable
    assert calls == ["flash_attention"]
    assert all(g.dtype == dtype for g in got)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    for g, c in zip(got, want_all):
        scale = c.abs().max().item()
        torch.testing.assert_close(g.float().cpu() / scale, c / scale, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_attention_contiguous_and_paged(dtype, monkeypatch):
    # A decode step as transformers' SDPA integration calls it (q packed to (B, Hkv,
    # group, D), the whole static cache, a (B, 1, 1, S_max) bool mask), then the ops
    # with per-row lengths: a 2048-position cache filled to 300 and 1500, GQA 8 over 2.
    b, hq, hkv, s, d = 2, 8, 2, 2048, 128
    q, k, v = (
        _randn(b, hq, 1, d, seed=6),
        _randn(b, hkv, s, d, seed=7),
        _randn(b, hkv, s, d, seed=8),
    )
    q, k, v = (x.to(dtype) for x in (q, k, v))
    lengths = torch.tensor([300, 1500])
    mask = torch.arange(s)[None, None, None, :] < lengths[:, None, None, None]
    packed = q.reshape(b, hkv, hq // hkv, d)
    want = F.scaled_dot_product_attention(packed.float(), k.float(), v.float(), attn_mask=mask)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        got = F.scaled_dot_product_attention(*(x.to("tpu") for x in (packed, k, v, mask)))
    assert calls == ["decode_sdpa"]
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    # The ops: contiguous with lengths, and the same cache cut into 128-position pages
    # laid out in a shuffled pool.
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    tq, tk, tv = (x.to("tpu") for x in (q, k, v))
    with torch.no_grad():
        out = tp.decode_attention(tq, tk, tv, lengths.to("tpu"), causal=True)
    torch.testing.assert_close(out.float().cpu(), ref, **tol)
    page, per_seq = 128, s // 128
    perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(9))
    pool_k = torch.empty(b * per_seq, hkv, page, d, dtype=dtype)
    pool_v = torch.empty_like(pool_k)
    table = perm.reshape(b, per_seq).int()
    for row in range(b):
        for j in range(per_seq):
            pool_k[table[row, j]] = k[row, :, j * page : (j + 1) * page]
            pool_v[table[row, j]] = v[row, :, j * page : (j + 1) * page]
    with torch.no_grad():
        paged = tp.paged_decode_attention(
            tq, pool_k.to("tpu"), pool_v.to("tpu"), table.to("tpu"), lengths.to("tpu")
        )
    torch.testing.assert_close(paged.float().cpu(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_ragged_dot_forward_and_backward(dtype):
    # 8 experts over 1000 rows (one group empty, rows past the groups zero), nn.Linear
    # layout (G, N, K), several row, k and n tiles at the chip's blocks.
    m, k, n = 1024, 1024, 768
    sizes = [200, 0, 96, 300, 1, 127, 176, 100]
    lhs, rhs = _randn(m, k, seed=10).to(dtype), (_randn(8, n, k, seed=11) * 0.05).to(dtype)
    cpu = [lhs.float().clone().requires_grad_(), rhs.float().clone().requires_grad_()]
    out, start = torch.zeros(m, n), 0
    for g, rows in enumerate(sizes):
        out[start : start + rows] = F.linear(cpu[0][start : start + rows], cpu[1][g])
        start += rows
    ct = _randn(m, n, seed=12)
    out.backward(ct)
    tpu = [lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()]
    got = tp.ragged_dot(*tpu, torch.tensor(sizes, device="tpu"), True)
    got.backward(ct.to(dtype).to("tpu"))
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    scale = out.abs().max().item()
    torch.testing.assert_close(got.float().cpu() / scale, out.detach() / scale, **tol)
    assert not got[sum(sizes) :].abs().sum().item()
    for t, c in zip(tpu, cpu):
        scale = c.grad.abs().max().item()
        torch.testing.assert_close(t.grad.float().cpu() / scale, c.grad / scale, **tol)


_identity_kernel = user_kernel.identity()


@tp.op("torchjax_tpu_tier::identity_kernel")
def identity_kernel(x, rows):
    # rows: torch's int64 indices, narrowed for the 32-bit function (checked on device).
    return _identity_kernel(x)[rows]


def test_a_users_kernel_op_in_eager_jit_and_compiled_training():
    x = _randn(64, 128, seed=13)
    rows = torch.tensor([3, 0, 63, 17])
    want = (x[rows] * 2).sum()
    # eager, with backward through the Pallas backward kernel
    t = x.to("tpu").requires_grad_()
    loss = (identity_kernel(t, rows.to("tpu")) * 2).sum()
    loss.backward()
    torch.testing.assert_close(loss.cpu(), want)
    grad = torch.zeros_like(x)
    grad[rows] = 2.0
    torch.testing.assert_close(t.grad.cpu(), grad)
    # torchjax.jit and torch.compile training: the pullback is traced by the outer program
    step = torchjax.jit(lambda a, r: (identity_kernel(a, r) * 2).sum())
    torch.testing.assert_close(step(x.to("tpu"), rows.to("tpu")).cpu(), want)
    t2 = x.to("tpu").requires_grad_()
    compiled = torch.compile(lambda a, r: (identity_kernel(a, r) * 2).sum(), backend="tpu")
    compiled(t2, rows.to("tpu")).backward()
    torch.testing.assert_close(t2.grad.cpu(), grad)


def test_tokamax_kernels_match_cpu():
    sizes = [100, 0, 156, 256]
    lhs, rhs = _randn(512, 256, seed=14), _randn(4, 256, 384, seed=15) * 0.05
    want = torch.cat([lhs[:100] @ rhs[0], lhs[100:256] @ rhs[2], lhs[256:] @ rhs[3]])
    got = tp.tokamax_ragged_dot(lhs.to("tpu"), rhs.to("tpu"), torch.tensor(sizes, device="tpu"))
    torch.testing.assert_close(got.cpu(), want, **F32_TOL)
    q, k, v = (_randn(1, 4, 512, 128, seed=s).bfloat16() for s in (16, 17, 18))
    cpu = [x.float().clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*cpu, is_causal=True)
    ref.sum().backward()
    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    out = tp.tokamax_attention(*tpu, causal=True)
    out.float().sum().backward()
    torch.testing.assert_close(out.float().cpu(), ref.detach(), **BF16_TOL)
    for t, c in zip(tpu, cpu):
        scale = c.grad.abs().max().item()
        torch.testing.assert_close(t.grad.float().cpu() / scale, c.grad / scale, **BF16_TOL)
