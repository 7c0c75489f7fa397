"""Numerical policies (README "Numerics"), each against CPU torch: matmul precision follows
torch's knob, integer division and remainder signs, division by zero, NaN propagation,
fully masked attention rows, and ``_grouped_mm`` (MoE) through ``lax.ragged_dot``."""

from __future__ import annotations

import math

import jax
import pytest
import torch
import torch.nn.functional as F
from jax import lax

import torchjax  # noqa: F401
from torchjax.ops import conv as conv_ops
from torchjax.ops import matmul as matmul_ops
from torchjax.testing.opinfo import compare, same, to_tpu

# ---------------------------------------------------------------------------------------
# (a) matmul precision: torch.get_float32_matmul_precision() -> lax.Precision


@pytest.fixture
def knob():
    """Set torch's float32 matmul precision for one test, restoring it after."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    "setting,expected",
    [
        ("highest", lax.Precision.HIGHEST),
        ("high", lax.Precision.HIGH),
        ("medium", lax.Precision.DEFAULT),
    ],
)
def test_matmul_precision_follows_torch_knob(knob, setting, expected):
    knob(setting)
    assert matmul_ops.matmul_precision() == expected


def test_allow_tf32_selects_high(knob):
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert matmul_ops.matmul_precision() == lax.Precision.HIGH
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert matmul_ops.matmul_precision() == lax.Precision.HIGHEST


def _dot_precisions(fn, *args):
    """The precision of every dot in the jaxpr of ``fn(*args)``."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [
        e.params["precision"]
        for e in jaxpr.eqns
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_precision_reaches_jax(knob, monkeypatch, setting):
    """The precision torch's knob selects is what the product's jax computation gets, on
    the eager path (a spy on the call) and in the lowering's jaxpr; float64 stays HIGHEST;
    values on CPU are the same for every setting."""
    knob(setting)
    want = matmul_ops.PRECISIONS[setting]
    seen = []

    def spy(dtype, precision):
        seen.append(precision)
        return orig(dtype, precision)

    orig = matmul_ops.precision_for
    monkeypatch.setattr(matmul_ops, "precision_for", spy)
    # A shape of its own: a compiled executable traced before would not call the spy.
    n = {"highest": 13, "high": 14, "medium": 15}[setting]
    a, b = torch.randn(3, n), torch.randn(n, 2)
    same(torch.mm, a, b)
    assert seen and set(seen) == {want}
    x = jax.numpy.ones((3, n), jax.numpy.float32)
    y = jax.numpy.ones((n, 2), jax.numpy.float32)
    monkeypatch.setattr(matmul_ops, "precision_for", orig)
    prec = matmul_ops.matmul_precision()
    assert _dot_precisions(lambda x, y: matmul_ops.mm(x, y, precision=prec), x, y) == [(want, want)]
    with jax.enable_x64(True):
        x64, y64 = x.astype("float64"), y.astype("float64")
        got = _dot_precisions(lambda x, y: matmul_ops.mm(x, y, precision=prec), x64, y64)
    assert got == [(lax.Precision.HIGHEST,) * 2]


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_conv_precision_follows_knob(knob, monkeypatch, setting):
    knob(setting)
    seen = []
    orig = conv_ops.precision_for
    monkeypatch.setattr(conv_ops, "precision_for", lambda d, p: seen.append(p) or orig(d, p))
    n = {"highest": 9, "high": 10, "medium": 11}[setting]
    x, w = torch.randn(1, 2, n), torch.randn(3, 2, 3, requires_grad=True)
    same(F.conv1d, x, w)
    assert seen and set(seen) == {matmul_ops.PRECISIONS[setting]}


def test_linear_and_matmul_values_equal_cpu_under_every_setting(knob):
    for setting in ("highest", "high", "medium"):
        knob(setting)
        x, w, bias = torch.randn(4, 6), torch.randn(5, 6), torch.randn(5)
        same(F.linear, x, w, bias)
        same(torch.matmul, torch.randn(2, 3, 4), torch.randn(4, 5))


# ---------------------------------------------------------------------------------------
# (b) integer division and remainder: signs follow torch (floor vs trunc), by zero raises

_A = [-7, -6, -1, 0, 1, 6, 7, -(2**40)]
_B = [2, -2, 3, -3, 2, -4, 5, 3]
_DIVISIONS = {
    "div_floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
    "div_trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "true_div": torch.div,
    "floordiv": lambda x, y: x // y,
    "mod": lambda x, y: x % y,
    "fmod": torch.fmod,
    "remainder": torch.remainder,
    "remainder_scalar": lambda x, y: torch.remainder(x, -3),
    "fmod_scalar": lambda x, y: torch.fmod(x, -3),
    "rfloordiv_scalar": lambda x, y: 5 // y,
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.float32])
@pytest.mark.parametrize("op", list(_DIVISIONS))
def test_division_signs(op, dtype):
    a = torch.tensor(_A if dtype == torch.int64 else _A[:-1], dtype=torch.int64)
    b = torch.tensor(_B if dtype == torch.int64 else _B[:-1], dtype=torch.int64)
    if dtype.is_floating_point:
        a = a.to(dtype) + 0.5
    same(_DIVISIONS[op], a, b.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize(
    "op", ["div_floor", "div_trunc", "floordiv", "mod", "fmod", "remainder", "mod_zero_scalar"]
)
def test_integer_division_by_zero_raises_like_cpu(op, dtype):
    fn = _DIVISIONS.get(op, lambda x, y: x % 0)
    a = torch.tensor([7, 2, 0], dtype=dtype)
    z = torch.tensor([1, 0, 1], dtype=dtype)
    with pytest.raises(RuntimeError) as cpu:
        fn(a, z)
    with pytest.raises(RuntimeError) as got:  # at the op, as on CPU
        fn(a.to("tpu"), z.to("tpu"))
    assert str(got.value) == str(cpu.value)


def test_float_division_by_zero_and_infinities():
    x = torch.tensor([5.0, -5.0, 0.0, math.inf, -0.0, 3.0, -3.0])
    y = torch.tensor([0.0, 0.0, 0.0, 2.0, 2.0, -math.inf, math.inf])
    for fn in _DIVISIONS.values():
        same(fn, x, y)
    same(lambda x, y: x / y, torch.tensor([1, -1, 0]), torch.tensor([0, 0, 0]))  # int / 0


# ---------------------------------------------------------------------------------------
# (c) NaN propagation: torch propagates NaN (fmax/fmin ignore it); sort puts NaN last

_NAN = float("nan")
_ROWS = torch.tensor([[1.0, _NAN, 3.0, -1.0], [4.0, 5.0, -6.0, 2.0], [_NAN, _NAN, 0.0, 1.0]])
_REDUCTIONS = {
    "min": torch.min,
    "max": torch.max,
    "amax": lambda x: torch.amax(x, 1),
    "amin": lambda x: torch.amin(x, 1),
    "min_dim": lambda x: torch.min(x, 1),
    "max_dim": lambda x: torch.max(x, 1),
    "aminmax": lambda x: torch.aminmax(x, dim=1),
    "argmax": lambda x: torch.argmax(x, 1),
    "argmin": lambda x: torch.argmin(x, 1),
    "argmax_all": torch.argmax,
    "sort": lambda x: torch.sort(x, 1),
    "sort_descending": lambda x: torch.sort(x, 1, descending=True),
    "sort_stable": lambda x: torch.sort(x, dim=1, stable=True),
    "argsort": lambda x: torch.argsort(x, dim=1, stable=True),
    # Rows with one NaN: CPU topk is not stable, so the index order of tied NaNs is not
    # specified (values match; test_sort.py checks indices by gather).
    "topk": lambda x: torch.topk(x[:2], 2, 1),
    "topk_smallest": lambda x: torch.topk(x[:2], 2, 1, largest=False),
    "msort": torch.msort,
    "median": lambda x: torch.median(x, 1),
    "nanmedian": lambda x: torch.nanmedian(x, 1),
    "cummax": lambda x: torch.cummax(x, 1),
    "cummin": lambda x: torch.cummin(x, 1),
    "clamp": lambda x: torch.clamp(x, 0.5, 2.0),
    "clamp_nan_bound": lambda x: torch.clamp(x, min=_NAN),
    "clamp_min": lambda x: torch.clamp_min(x, 2.0),
    "relu": torch.relu,
    "hardtanh": F.hardtanh,
    "max_pool1d": lambda x: F.max_pool1d(x[None], 2),
    "logsumexp": lambda x: torch.logsumexp(x, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(_REDUCTIONS))
def test_nan_propagation(op, dtype):
    same(_REDUCTIONS[op], _ROWS.to(dtype))


_X = torch.tensor([1.0, _NAN, 3.0, -1.0, _NAN])
_Y = torch.tensor([2.0, 0.0, _NAN, -2.0, _NAN])


@pytest.mark.parametrize(
    "fn",
    [
        torch.maximum,
        torch.minimum,
        torch.fmax,
        torch.fmin,
        torch.max,
        torch.min,
        lambda x, y: torch.clamp(x, min=y),
        lambda x, y: torch.clamp(x, max=y),
        lambda x, y: torch.clamp(x, y - 1, y + 1),
    ],
    ids=["maximum", "minimum", "fmax", "fmin", "max", "min", "clamp_min", "clamp_max", "clamp"],
)
def test_nan_propagation_binary(fn):
    same(fn, _X, _Y)


def test_sort_puts_nan_last_both_directions():
    x = torch.tensor([3.0, _NAN, -math.inf, 1.0, math.inf, _NAN, 0.0])
    got = torch.sort(x.to("tpu")).values.cpu()
    assert torch.isnan(got[-2:]).all() and torch.equal(got[:-2], torch.sort(x).values[:-2])
    got = torch.sort(x.to("tpu"), descending=True).values.cpu()
    assert torch.isnan(got[:2]).all()  # descending: NaN first, as CPU


# ---------------------------------------------------------------------------------------
# (d) scaled_dot_product_attention: fully masked rows give zeros (finite) as on CPU


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, 4, 8, generator=g).to(dtype) for _ in range(3)]


def _masks():
    boolean = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    boolean[0, :, 1] = False  # query 1 of batch 0 sees nothing
    additive = torch.zeros(2, 1, 4, 4)
    additive[0, :, 1] = -math.inf
    return {"bool": boolean, "additive_inf": additive}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "additive_inf"])
def test_sdpa_fully_masked_row_is_zero_like_cpu(kind, dtype):
    q, k, v = _qkv(dtype)
    mask = _masks()[kind].to(dtype) if kind != "bool" else _masks()[kind]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(want[0, :, 1], torch.zeros_like(want[0, :, 1]))  # torch 2.13 CPU
    got = same(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
    assert torch.isfinite(got.cpu()).all()


@pytest.mark.parametrize("kind", ["bool", "additive_inf"])
def test_sdpa_fully_masked_row_gradients_finite(kind):
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = _masks()[kind]
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(), q)
    tq, tk, tv = to_tpu((q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask.to("tpu"))
    got = torch.autograd.grad(out.sum(), tq)
    compare(got, want, "grad q")
    assert torch.isfinite(got[0].cpu()).all()


class _TinyAttentionLM(torch.nn.Module):
    """Two HF-style decoder layers (q/k/v/o projections, SDPA with a boolean causal and
    padding mask, MLP, residuals): left-padded queries see no key at all."""

    def __init__(self, vocab=11, dim=16, heads=2, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "qkv": torch.nn.Linear(dim, 3 * dim),
                    "o": torch.nn.Linear(dim, dim),
                    "mlp": torch.nn.Linear(dim, dim),
                }
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, attention_mask):
        b, s = ids.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        h = self.embed(ids)
        for layer in self.layers:
            q, k, v = layer["qkv"](h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + layer["o"](a.transpose(1, 2).reshape(b, s, -1))
            h = h + torch.tanh(layer["mlp"](h))
        return self.head(h)


def test_padded_batch_attention_has_no_nan():
    torch.manual_seed(0)
    model = _TinyAttentionLM()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model(ids, attention_mask)
    got = model.to("tpu")(ids.to("tpu"), attention_mask.to("tpu"))
    got_cpu = got.detach().cpu()
    assert torch.isfinite(got_cpu).all()  # padded rows too: nothing NaN to spread
    torch.testing.assert_close(got_cpu, want.detach(), rtol=1e-4, atol=1e-5)
    got.sum().backward()
    assert all(torch.isfinite(p.grad.cpu()).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# aten::_grouped_mm (transformers' MoE path): lax.ragged_dot, vs a per-group loop


def _grouped_reference(x, w, offs):
    """Rows of ``x`` split at cumulative ``offs``, each group times its ``w[g]``. Rows past
    offs[-1] are zero here and in torchjax; CPU torch leaves them uninitialised."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].float() @ w[g].float()
        start = end
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_2d_3d_forward_backward(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(3, 8, 16, generator=g).to(dtype).requires_grad_()
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # an empty group; 2 tail rows
    want = _grouped_reference(x, w, offs)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    try:
        cpu = torch._grouped_mm(x, w, offs=offs)
        torch.testing.assert_close(cpu[:8], want[:8], **tol)  # CPU torch agrees with the loop
    except (RuntimeError, NotImplementedError):
        cpu = None  # no CPU kernel for this dtype in this torch build: the loop is the oracle
    tx, tw = to_tpu((x, w))
    got = torch._grouped_mm(tx, tw, offs=offs.to("tpu"))
    assert got.dtype == dtype and got.shape == (10, 16)
    torch.testing.assert_close(got.detach().cpu(), want, **tol)
    weights = torch.randn(10, 16, generator=g).to(dtype)
    gx, gw = torch.autograd.grad((_grouped_reference(x, w, offs) * weights).sum(), (x, w))
    tgx, tgw = torch.autograd.grad((got * weights.to("tpu")).sum(), (tx, tw))
    torch.testing.assert_close(tgx.cpu(), gx, **tol)
    torch.testing.assert_close(tgw.cpu(), gw, **tol)
    assert cpu is None or cpu.dtype == got.dtype


def test_grouped_mm_goes_through_ragged_dot(monkeypatch):
    calls = []
    orig = lax.ragged_dot
    monkeypatch.setattr(
        matmul_ops.lax, "ragged_dot", lambda *a, **k: calls.append(a[2].shape) or orig(*a, **k)
    )
    x, w = torch.randn(7, 4), torch.randn(2, 4, 5)
    offs = torch.tensor([2, 7], dtype=torch.int32)
    got = torch._grouped_mm(x.to("tpu"), w.to("tpu"), offs=offs.to("tpu"))
    torch.testing.assert_close(got.cpu(), _grouped_reference(x, w, offs))
    assert calls, "lax.ragged_dot was not called"
