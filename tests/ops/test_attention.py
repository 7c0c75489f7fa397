"""Tests for torchjax/ops/attention.py: F.scaled_dot_product_attention on tpu tensors
(the math path, see the module docstring) and a transformer block, vs CPU torch."""

import pytest
import torch
import torch.nn.functional as F

import torchjax
from tests.ops.opinfo_cases import make_tests
from torchjax.ops import cached_compute
from torchjax.testing import checks
from torchjax.testing import opinfo as oi

OPS = ["torch.ops.aten._safe_softmax.default"]
globals().update(make_tests(OPS))

# SDPA and multi-head attention samples with dropout draw random masks (torchjax's RNG is
# not CPU torch's), so the sweep below runs the deterministic OpInfo samples only; dropout
# is checked statistically in test_sdpa_dropout_statistics.
_RANDOM_OPS = [
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.multi_head_attention_forward",
]
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _deterministic(samples):
    return [s for s in samples if not s.kwargs.get("dropout_p") and not s.kwargs.get("training")]


@pytest.mark.parametrize("op", oi.opinfos(_RANDOM_OPS), ids=oi.full_name)
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_opinfo_attention_forward(op, dtype):
    for s in _deterministic(oi.samples(op, dtype)):
        checks.check_forward(op, s)


# multi_head_attention_forward's grad samples all use training=True (dropout).
@pytest.mark.parametrize("op", oi.opinfos(_RANDOM_OPS[:1]), ids=oi.full_name)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_opinfo_attention_backward(op, dtype):
    ran = [
        checks.check_backward(op, s)
        for s in _deterministic(oi.samples(op, dtype, requires_grad=True))
    ]
    assert any(ran)


def _sdpa_matches(q, k, v, rtol=1e-5, atol=1e-6, **kw):
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    tpu = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    tkw = {n: (a.to("tpu") if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    want = F.scaled_dot_product_attention(*cpu, **kw)
    got = F.scaled_dot_product_attention(*tpu, **tkw)
    torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=rtol, atol=atol)
    go = torch.randn(want.shape, dtype=want.dtype)
    gw = torch.autograd.grad(want, cpu, go)
    gt = torch.autograd.grad(got, tpu, go.to("tpu"))
    for a, b in zip(gt, gw):
        assert torch.isfinite(a.cpu()).all()
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol)


def _qkv(hq=4, hk=4, lq=5, lk=6, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, hq, lq, d, generator=g, dtype=dtype),
        torch.randn(2, hk, lk, d, generator=g, dtype=dtype),
        torch.randn(2, hk, lk, d, generator=g, dtype=dtype),
    )


def test_sdpa_plain_and_scale():
    _sdpa_matches(*_qkv())
    _sdpa_matches(*_qkv(), scale=0.3)


def test_sdpa_causal():
    _sdpa_matches(*_qkv(lq=6, lk=6), is_causal=True)


def test_sdpa_bool_mask_with_fully_masked_row():
    mask = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, :, 0] = False  # e.g. left padding: the whole row is masked
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(want).all()
    _sdpa_matches(q, k, v, attn_mask=mask)


def test_sdpa_additive_mask():
    mask = torch.randn(5, 6, dtype=torch.float64)
    _sdpa_matches(*_qkv(), attn_mask=mask)


def test_sdpa_gqa():
    _sdpa_matches(*_qkv(hq=6, hk=2), enable_gqa=True)
    _sdpa_matches(*_qkv(hq=6, hk=2, lq=6, lk=6), enable_gqa=True, is_causal=True)


_MASK = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
_MASK[:, :, 0] = False


# Calls of the fused SDPA path (Note [Fused SDPA in eager]); "hq", "hk", "lq", "lk", "d"
# are _qkv's shapes, the rest SDPA's keywords.
_FUSED_CASES = {
    "plain": {},
    "causal-scale": {"scale": 0.3, "is_causal": True, "lq": 6, "lk": 6},
    "bool-mask": {"attn_mask": _MASK},
    "float-mask": {"attn_mask": _MASK.double().log()},
    "gqa": {"enable_gqa": True, "hq": 6, "hk": 2},
}


def _shapes_and_keywords(kw):
    kw = dict(kw)
    return {n: kw.pop(n) for n in ("hq", "hk", "lq", "lk", "d") if n in kw}, kw


@pytest.mark.parametrize("kw", _FUSED_CASES.values(), ids=_FUSED_CASES.keys())
def test_sdpa_no_grad_is_one_fused_op(kw):
    # Note [Fused SDPA in eager]: without autograd the call is one compiled lowering.
    shape, kw = _shapes_and_keywords(kw)
    q, k, v = _qkv(**shape)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    tkw = {n: (a.to("tpu") if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    before = cached_compute.cache_info(torch.ops.aten.scaled_dot_product_attention.default).traces
    with torch.no_grad():
        got = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), **tkw)
    after = cached_compute.cache_info(torch.ops.aten.scaled_dot_product_attention.default).traces
    assert after == before + 1
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


_BF16_CASES = {**_FUSED_CASES, "causal-64": {"is_causal": True, "lq": 64, "lk": 64, "d": 32}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", _BF16_CASES.values(), ids=_BF16_CASES.keys())
def test_sdpa_no_grad_half_is_one_op_with_the_math_paths_numbers(kw, dtype):
    # Note [Fused SDPA in eager]: bfloat16 without autograd is the decomposition traced
    # into one executable: bit for bit what the decomposition computes op by op (taken
    # here by asking for a gradient), and one executable instead of eight.
    shape, kw = _shapes_and_keywords(kw)
    q, k, v = (t.to(dtype).to("tpu") for t in _qkv(**shape))
    tkw = {
        n: (a.to(dtype if a.is_floating_point() else a.dtype).to("tpu"))
        if isinstance(a, torch.Tensor)
        else a
        for n, a in kw.items()
    }
    op = torch.ops.aten.scaled_dot_product_attention.default
    before = cached_compute.cache_info(op).calls
    # The count is of plain eager's executables (fused eager records the op instead;
    # tests/ops/test_fused.py checks it against plain eager).
    with torch.no_grad(), torchjax.fused(False):
        got = F.scaled_dot_product_attention(q, k, v, **tkw)
    assert cached_compute.cache_info(op).calls == before + 1
    q.requires_grad_(True)
    want = F.scaled_dot_product_attention(q, k, v, **tkw)  # the decomposition, op by op
    assert cached_compute.cache_info(op).calls == before + 1
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.cpu().view(torch.int16), want.detach().cpu().view(torch.int16))


def test_sdpa_float32():
    _sdpa_matches(*_qkv(dtype=torch.float32), rtol=1e-4, atol=1e-5, is_causal=True)


def test_sdpa_dropout_statistics():
    # Dropout masks come from torchjax's RNG, so only the statistics can match CPU: with
    # v = 1 every output is the sum of the kept, rescaled attention weights.
    q = torch.randn(1, 2, 64, 8).to("tpu")
    v = torch.ones(1, 2, 64, 8).to("tpu")
    out = F.scaled_dot_product_attention(q, q, v, dropout_p=0.5).cpu()
    assert torch.isfinite(out).all()
    assert abs(out.mean().item() - 1.0) < 0.1
    ref = F.scaled_dot_product_attention(q, q, v, dropout_p=0.0).cpu()
    torch.testing.assert_close(ref, torch.ones_like(ref))


class _Block(torch.nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


def test_transformer_block_forward_backward():
    torch.manual_seed(0)
    cpu = _Block().double()
    tpu = _Block().double()
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False  # left padding in sample 0: its first rows are fully masked
    cx, tx = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    want, got = cpu(cx, mask), tpu(tx, mask.to("tpu"))
    torch.testing.assert_close(got.detach().cpu(), want.detach())
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(tx.grad.cpu(), cx.grad)
    for (name, p), tp in zip(cpu.named_parameters(), tpu.parameters()):
        torch.testing.assert_close(tp.grad.cpu(), p.grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("lq,lk", [(4, 4), (3, 5), (5, 3)])
def test_sdpa_mask_and_is_causal_together_apply_both_as_cpu(mask_kind, lq, lk):
    # CPU's default kernel applies the mask and the causal triangle; the math path (our
    # decomposition) refuses the pair, so the flag is folded into the mask first.
    q, k, v = _qkv(lq=lq, lk=lk, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(lq, lk, generator=g) > 0.3
    if mask_kind == "float":
        mask = torch.randn(1, 1, lq, lk, generator=g)
    want_q = q.clone().requires_grad_()
    want = F.scaled_dot_product_attention(want_q, k, v, attn_mask=mask, is_causal=True)
    got_q = q.to("tpu").requires_grad_()
    got = F.scaled_dot_product_attention(
        got_q, k.to("tpu"), v.to("tpu"), attn_mask=mask.to("tpu"), is_causal=True
    )
    torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(got_q.grad.cpu(), want_q.grad, equal_nan=True)
    with torch.no_grad():
        fused = F.scaled_dot_product_attention(
            q.to("tpu"), k.to("tpu"), v.to("tpu"), attn_mask=mask.to("tpu"), is_causal=True
        )
    torch.testing.assert_close(fused.cpu(), want.detach(), equal_nan=True)


@pytest.mark.parametrize(
    "shapes,kw",
    [
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {}),  # 3-D: CPU's math path
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 6)), {}),  # head dims differ
        (((2, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), {}),  # batch broadcast
    ],
    ids=["3d", "value-head-dim", "batch-broadcast"],
)
def test_sdpa_mask_and_is_causal_refused_where_cpu_takes_its_math_path(shapes, kw):
    q, k, v = (torch.randn(*s) for s in shapes)
    mask = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) > 0.3
    for dev in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set"):
            F.scaled_dot_product_attention(
                q.to(dev), k.to(dev), v.to(dev), attn_mask=mask.to(dev), is_causal=True, **kw
            )


def test_sdpa_bfloat16_empty_keys_give_plus_zero_as_op_by_op():
    q = torch.randn(1, 1, 2, 4).bfloat16()
    k, v = torch.randn(1, 1, 0, 4).bfloat16(), torch.randn(1, 1, 0, 3).bfloat16()
    with torch.no_grad():
        got = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"))
    want = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


# Shapes torch's math path refuses: the fused path (no autograd) raised jax's ValueError,
# TypeError or IndexError, where CPU raises RuntimeError or IndexError with its own text
# (Note [Fused SDPA in eager]).
_REFUSED_SHAPES = {
    "heads": (((1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)), {}),
    "heads-gqa-off": (((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}),
    "heads-gqa-not-dividing": (((1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)), {"gqa": 1}),
    "heads-gqa-6-4": (((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16)), {"gqa": 1}),
    "head-dim": (((1, 4, 8, 16), (1, 4, 8, 8), (1, 4, 8, 16)), {}),
    "batch": (((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16)), {}),
    "mask-length": (((1, 4, 8, 16),) * 3, {"mask": (8, 7)}),
    "gqa-2d": (((8, 16),) * 3, {"gqa": 1}),  # IndexError: no heads dim
}


@pytest.mark.parametrize("shapes,kw", _REFUSED_SHAPES.values(), ids=_REFUSED_SHAPES.keys())
def test_sdpa_without_grad_refuses_mismatched_shapes_as_cpu(shapes, kw):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in shapes)
    extra = {"enable_gqa": bool(kw.get("gqa"))}
    if "mask" in kw:
        extra["attn_mask"] = torch.randn(*kw["mask"], generator=g)
    with pytest.raises((RuntimeError, IndexError)) as cpu:
        F.scaled_dot_product_attention(q, k, v, **extra)
    moved = {n: (a.to("tpu") if isinstance(a, torch.Tensor) else a) for n, a in extra.items()}
    with pytest.raises(type(cpu.value)) as tpu:
        F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), **moved)
    # The same type and text; torchjax names the op after a broadcasting or bmm error.
    assert type(tpu.value) is type(cpu.value)
    assert str(cpu.value) in str(tpu.value)


def test_sdpa_under_jit_refuses_mismatched_heads_as_cpu():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(RuntimeError) as cpu:
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError) as tpu, torch.no_grad():
        torchjax.jit(F.scaled_dot_product_attention)(q.to("tpu"), k.to("tpu"), k.to("tpu"))
    assert str(tpu.value) == str(cpu.value)


def test_bmm_refuses_mismatched_shapes_with_cpus_text():
    for a, b in [((4, 8, 16), (4, 8, 8)), ((3, 8, 7), (4, 7, 16))]:
        with pytest.raises(RuntimeError) as cpu:
            torch.bmm(torch.ones(a), torch.ones(b))
        with pytest.raises(RuntimeError) as tpu:
            torch.bmm(torch.ones(a, device="tpu"), torch.ones(b, device="tpu"))
        # CPU's text, then the op's name.
        assert str(tpu.value) == f"{cpu.value} (in aten::bmm.default)"


# Odd SDPA calls, (q, k, v) shapes and keywords; "mask" is a float mask's shape, "bool"
# a bool mask's. CPU answers each with its flash kernel or its math path (Note [CPU's SDPA
# kernel choice] in torchjax/ops/attention_checks.py); tpu must give the same values (NaN
# where CPU has NaN) or raise the same exception with CPU's text first.
_B, _H, _L, _S, _E = 2, 3, 5, 7, 8
_Q, _K = (_B, _H, _L, _E), (_B, _H, _S, _E)
_ODD_CASES = {
    "empty-queries": (((_B, _H, 0, _E), _K, _K), {}),
    "empty-keys": ((_Q, (_B, _H, 0, _E), (_B, _H, 0, _E)), {}),
    "empty-keys-causal": ((_Q, (_B, _H, 0, _E), (_B, _H, 0, _E)), {"is_causal": True}),
    "empty-batch": (((0, _H, _L, _E), (0, _H, _S, _E), (0, _H, _S, _E)), {}),
    "empty-head-dim": (((_B, _H, _L, 0), (_B, _H, _S, 0), (_B, _H, _S, 3)), {}),
    "empty-head-dim-3d": (((_B, _L, 0), (_B, _S, 0), (_B, _S, 3)), {}),
    "value-head-dim": ((_Q, _K, (_B, _H, _S, 3)), {}),
    "value-head-dim-causal": ((_Q, _K, (_B, _H, _S, 3)), {"is_causal": True}),
    "value-head-dim-mask": ((_Q, _K, (_B, _H, _S, 3)), {"mask": (_L, _S)}),
    "key-head-dim": ((_Q, (_B, _H, _S, 4), _K), {}),
    "scale-0": ((_Q, _K, _K), {"scale": 0.0}),
    "scale-negative": ((_Q, _K, _K), {"scale": -1.0}),
    "scale-negative-3d": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {"scale": -0.5}),
    "bool-mask-row-false": ((_Q, _K, _K), {"bool": (_L, _S), "false_row": 1}),
    "bool-mask-all-false": ((_Q, _K, _K), {"bool": (_L, _S), "false_row": None}),
    "float-mask-2d": ((_Q, _K, _K), {"mask": (_L, _S)}),
    "float-mask-column": ((_Q, _K, _K), {"mask": (_L, 1)}),
    "float-mask-1d": ((_Q, _K, _K), {"mask": (_S,)}),
    "float-mask-0d": ((_Q, _K, _K), {"mask": ()}),
    "float-mask-1d-3d-inputs": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {"mask": (_S,)}),
    "float-mask-1d-causal": ((_Q, _K, _K), {"mask": (_S,), "is_causal": True}),
    "float-mask-too-long": ((_Q, _K, _K), {"mask": (_L, _S + 1)}),
    "float-mask-grows": ((_Q, _K, _K), {"mask": (4, _B, _H, _L, _S)}),
    "float-mask-grows-batch": (
        ((1, _H, _L, _E), (1, _H, _S, _E), (1, _H, _S, _E)),
        {"mask": (_B, _H, _L, _S)},
    ),  # fmt: skip
    "gqa": (((_B, 6, _L, _E), (_B, 3, _S, _E), (_B, 3, _S, _E)), {"enable_gqa": True}),
    "gqa-not-dividing": (((_B, 6, _L, _E), (_B, 4, _S, _E), (_B, 4, _S, _E)), {"enable_gqa": True}),
    "gqa-off": (((_B, 6, _L, _E), (_B, 3, _S, _E), (_B, 3, _S, _E)), {}),
    "gqa-causal-mask": (
        ((_B, 6, _L, _E), (_B, 3, _S, _E), (_B, 3, _S, _E)),
        {"enable_gqa": True, "is_causal": True, "mask": (_L, _S)},
    ),  # fmt: skip
    "causal-mask-too-long": ((_Q, _K, _K), {"mask": (_L, _S + 1), "is_causal": True}),
    "causal-mask-3d": ((_Q, _K, _K), {"mask": (_H, _L, _S), "is_causal": True}),
    "dropout-causal-mask": ((_Q, _K, _K), {"mask": (_L, _S), "is_causal": True, "dropout_p": 0.5}),
    "dropout-negative": ((_Q, _K, _K), {"dropout_p": -0.1}),
    "dropout-negative-3d": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {"dropout_p": -0.1}),
    "dropout-negative-value-head-dim": ((_Q, _K, (_B, _H, _S, 3)), {"dropout_p": -0.1}),
    "dropout-above-1": ((_Q, _K, _K), {"dropout_p": 1.5}),
    "3d": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {}),
    "3d-causal": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {"is_causal": True}),
    "3d-mask": (((_B, _L, _E), (_B, _S, _E), (_B, _S, _E)), {"mask": (_L, _S)}),
    "batch-mismatch": ((_Q, (3, _H, _S, _E), (3, _H, _S, _E)), {}),
    "int-inputs": ((_Q, _K, _K), {"dtype": torch.int64}),
}


def _odd_call(shapes, kw, device, mode, dtype):
    g = torch.Generator().manual_seed(0)
    kw = dict(kw)
    dtype = kw.pop("dtype", dtype)
    args = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    if "mask" in kw:
        kw["attn_mask"] = torch.randn(kw.pop("mask"), generator=g, dtype=torch.float64).to(dtype)
    if "bool" in kw:
        mask = torch.ones(kw.pop("bool"), dtype=torch.bool)
        row = kw.pop("false_row")
        mask[slice(None) if row is None else row] = False
        kw["attn_mask"] = mask
    args = [a.to(device) for a in args]
    kw = {n: (a.to(device) if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    if mode == "grad":
        args = [a.requires_grad_(a.is_floating_point()) for a in args]
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    try:
        if mode == "grad":
            out = F.scaled_dot_product_attention(*args, **kw)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            return out.detach().cpu(), [a.grad.cpu() for a in args if a.grad is not None]
        with context:
            return F.scaled_dot_product_attention(*args, **kw).cpu(), []
    except (RuntimeError, IndexError) as error:
        return error, []


# Every odd case in every mode, except dropout with gradients: dropout draws torchjax's
# random masks, not CPU's, so only its refusals and no-grad values compare.
_ODD_RUNS = [
    pytest.param(shapes, kw, mode, id=f"{name}-{mode}")
    for name, (shapes, kw) in _ODD_CASES.items()
    for mode in ("no_grad", "grad", "inference")
    if not (kw.get("dropout_p", 0) > 0 and mode == "grad")
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shapes,kw,mode", _ODD_RUNS)
def test_sdpa_odd_inputs_as_cpu(shapes, kw, mode, dtype):
    want, want_grads = _odd_call(shapes, kw, "cpu", mode, dtype)
    got, got_grads = _odd_call(shapes, kw, "tpu", mode, dtype)
    if isinstance(want, Exception):
        assert type(got) is type(want), (want, got)
        assert str(got).startswith(str(want)), (want, got)
        return
    assert not isinstance(got, Exception), got
    assert got.dtype == want.dtype and got.shape == want.shape
    for a, b in zip([got, *got_grads], [want, *want_grads]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
