"""SDPA's math fallback by platform (Note [SDPA math by platform]): the TPU entry,
``torch.ops.torchjax.exact_attention``, run on CPU against CPU torch's
``F.scaled_dot_product_attention``, forward and gradients of q, k, v, in eager, under
``torchjax.jit`` and under ``torch.compile(backend="tpu")``; the table and its overrides."""

import jax
import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax import pallas as tp
from torchjax.pallas import _sdpa

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bool_mask(shape, dead_row):
    mask = _randn(*shape, seed=7) > -0.5
    mask[(..., dead_row, slice(None))] = False  # a fully masked row: zeros, as torch
    return mask


# name -> (q, k, v shapes, SDPA keywords); masks are made per dtype in _case.
CASES = {
    "gqa": (((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), {"enable_gqa": True}),
    "mha": (((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8)), {}),
    "bool-mask-dead-row": (((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), {"bool": (2, 1, 5, 7)}),
    "bool-mask-per-head": (((1, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 8)), {"bool": (4, 5, 7)}),
    "float-mask": (((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)), {"float": (1, 1, 5, 7)}),
    "causal-short-queries": (((2, 2, 5, 8), (2, 2, 9, 8), (2, 2, 9, 8)), {"is_causal": True}),
    "causal-long-queries": (((1, 4, 9, 8), (1, 2, 6, 8), (1, 2, 6, 8)), {"is_causal": True}),
    "3d": (((3, 5, 8), (3, 7, 8), (3, 7, 4)), {"scale": 0.5}),
    "negative-scale": (((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), {"scale": -0.3}),
    "leading-dims": (((2, 1, 2, 4, 8), (2, 1, 2, 6, 8), (2, 1, 2, 6, 8)), {"float": (4, 6)}),
}


def _case(name, dtype):
    shapes, kw = CASES[name]
    q, k, v = (_randn(*s, seed=i).to(dtype) for i, s in enumerate(shapes))
    kw = dict(kw)
    if "bool" in kw:
        kw["attn_mask"] = _bool_mask(kw.pop("bool"), dead_row=1)
    if "float" in kw:
        kw["attn_mask"] = _randn(*kw.pop("float"), seed=9).to(dtype)
    if shapes[0][-3] != shapes[1][-3]:
        kw["enable_gqa"] = True
    return (q, k, v), kw


# bfloat16: CPU torch rounds scores and probabilities to bfloat16 on its math path and
# the gradients on both sides are rounded once more; this op keeps float32 throughout.
_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
_GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def _spy(monkeypatch):
    calls, exact = [], _sdpa.exact_sdpa
    monkeypatch.setattr(
        _sdpa, "exact_sdpa", lambda *a, **kw: calls.append(tuple(a[0].shape)) or exact(*a, **kw)
    )
    return calls


def _runner(mode, kw):
    mask = kw.get("attn_mask")
    rest = {n: a for n, a in kw.items() if n != "attn_mask"}

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **rest)

    run = {
        "eager": attend,
        "jit": torchjax.jit(attend),
        "compile": torch.compile(attend, backend="tpu", dynamic=False),
    }[mode]
    return lambda q, k, v: run(q, k, v, None if mask is None else mask.to("tpu"))


@pytest.mark.parametrize("mode", ["eager", "jit", "compile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_tpu_entry_matches_cpu_torch_with_grads(name, dtype, mode, monkeypatch):
    (q, k, v), kw = _case(name, dtype)
    cpu = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*cpu, **kw)
    ct = _randn(*want.shape, seed=5).to(dtype)
    want_grads = torch.autograd.grad(want, cpu, ct)
    calls = _spy(monkeypatch)
    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    with tp.use_flash_attention(False), tp.use_math_attention("exact"):
        got = _runner(mode, kw)(*tpu)
    assert calls, "the exact op did not take the call"
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.detach().cpu(), want.detach(), **_TOL[dtype])
    got_grads = torch.autograd.grad(got, tpu, ct.to("tpu"))
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, **_GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_tpu_entry_without_grad_and_under_inference_mode(dtype, monkeypatch):
    # Ahead of the fused eager math (no grad) and from the registry handler (inference).
    (q, k, v), kw = _case("bool-mask-dead-row", dtype)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    calls = _spy(monkeypatch)
    args = [x.to("tpu") for x in (q, k, v)]
    mask = kw.pop("attn_mask").to("tpu")
    with tp.use_math_attention("exact"):
        with torch.no_grad():
            plain = F.scaled_dot_product_attention(*args, attn_mask=mask, **kw)
        with torch.inference_mode():
            inference = F.scaled_dot_product_attention(*args, attn_mask=mask, **kw)
    assert len(calls) == 2
    for out in (plain, inference):
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu(), want, atol=1e-6, rtol=1e-6)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    (q, k, v), kw = _case("bool-mask-dead-row", torch.float32)
    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    mask = kw["attn_mask"].to("tpu")
    with tp.use_math_attention("exact"):
        out = F.scaled_dot_product_attention(*tpu, attn_mask=mask, enable_gqa=True)
    assert (out[:, :, 1].detach().cpu() == 0).all()
    out.sum().backward()
    for t in tpu:
        assert torch.isfinite(t.grad.cpu()).all()


def test_platform_table_and_overrides(monkeypatch):
    assert tp.MATH_BY_PLATFORM["tpu"] == "exact"
    assert tp.MATH_BY_PLATFORM["cpu"] == "decompose"
    (q, k, v), kw = _case("gqa", torch.float32)
    calls = _spy(monkeypatch)
    args = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    monkeypatch.delenv(tp.SDPA_MATH_ENV_VAR, raising=False)
    F.scaled_dot_product_attention(*args, **kw)  # the table's CPU entry
    assert calls == [] and jax.default_backend() == "cpu"
    monkeypatch.setenv(tp.SDPA_MATH_ENV_VAR, "exact")
    F.scaled_dot_product_attention(*args, **kw)
    assert len(calls) == 1
    with tp.use_math_attention("decompose"):  # the context wins over the env var
        F.scaled_dot_product_attention(*args, **kw)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="use_math_attention: expected one of"):
        tp.use_math_attention("fast")


@pytest.mark.parametrize(
    "why",
    ["mask requires grad", "dropout", "mixed dtypes", "mask of another float dtype"],
)
def test_calls_the_op_does_not_take_keep_the_decomposition(why, monkeypatch):
    (q, k, v), kw = _case("float-mask", torch.float32)
    mask = kw["attn_mask"]
    extra = {}
    if why == "mask requires grad":
        mask = mask.clone().requires_grad_()
    elif why == "dropout":
        extra = {"dropout_p": 0.5}
    elif why == "mixed dtypes":
        v = v.double()
    else:
        mask = mask.double()
    calls = _spy(monkeypatch)
    args = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    tmask = mask.detach().to("tpu").requires_grad_(mask.requires_grad)
    try:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **extra)
    except RuntimeError as error:
        want = error
    with tp.use_math_attention("exact"):
        try:
            got = F.scaled_dot_product_attention(*args, attn_mask=tmask, enable_gqa=True, **extra)
        except RuntimeError as error:
            got = error
    assert calls == []
    if isinstance(want, Exception):  # torch's own refusal, from the decomposition
        assert type(got) is type(want) and str(got).startswith(str(want)), (got, want)
    else:
        assert got.shape == want.shape and got.dtype == want.dtype
