"""torchjax/ops/dtype_refusals.py: the dtypes CPU torch refuses are refused on tpu, with
torch's exception type and message, for every entry of the generated table; the calls
CPU accepts (another dtype, a listed shape, another value of a deciding argument) run."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from torchjax.ops.dtype_refusals import REFUSED
from torchjax.tensor.dtypes import aten_type_name
from torchjax.testing import dtype_refusals as survey
from torchjax.testing import opinfo as oi

# One case per (overload, entry, dtype) of the table, each replaying the op_db sample the
# survey recorded for it.
ENTRIES = [
    pytest.param(key, i, dtype, id=f"{key}-{i}-{dtype}")
    for key, entries in sorted(REFUSED.items())
    for i, entry in enumerate(entries)
    for dtype in sorted(entry["samples"])
]


def _outcome(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e), str(e).split(" (in aten::")[0]
    return None


def _call(fn):
    return lambda s: fn(s.input, *s.args, **s.kwargs)


def test_table_is_not_empty():
    assert len(ENTRIES) > 500


@pytest.mark.parametrize("key,index,dtype", ENTRIES)
def test_entry_refused_as_cpu(key, index, dtype):
    entry = REFUSED[key][index]
    ref = entry["samples"][dtype]
    (opinfo,) = oi.opinfos([ref[0]])
    fn = survey.op(ref)
    found, _ = survey.run(fn, survey.sample(ref))
    message = entry["message"].replace("{type}", aten_type_name(getattr(torch, dtype)))
    # The sample still reaches this overload on CPU and is refused as the table says.
    assert found is not None, f"CPU accepts {ref}: regenerate the table"
    assert (found[0], found[1], found[5]) == (key, getattr(torch, dtype), entry["error"])
    want = _outcome(_call(fn), survey.sample(ref))
    assert want[1] == message
    got = _outcome(_call(fn), oi.to_tpu(survey.sample(ref), opinfo))
    assert got == want


# Binary kernels refuse the dtype their arguments promote to (TensorIterator's common
# dtype), whatever dtypes the arguments hold: hypot of int8 and int16 refuses 'Short'.
MIXED_BINARY = {
    "hypot": torch.hypot,
    "atan2": torch.atan2,
    "copysign": torch.copysign,
    "nextafter": torch.nextafter,
    "fmod": torch.fmod,
    "remainder": torch.remainder,
    "floor_divide": torch.floor_divide,
    "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2,
    "xlogy": torch.xlogy,
    "xlog1py": torch.special.xlog1py,
    "igamma": torch.igamma,
    "igammac": torch.igammac,
    "zeta": torch.special.zeta,
    "gcd": torch.gcd,
    "lcm": torch.lcm,
    "lshift": torch.bitwise_left_shift,
    "rshift": torch.bitwise_right_shift,
    "pow": torch.pow,
}
_INTEGRAL = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _values(dtype, shape):
    return torch.tensor([True, False, True] if dtype == torch.bool else [3, 5, 1], dtype=dtype)[
        : 1 if shape == () else 3
    ].reshape(shape)


def _same_outcome(fn, *args):
    """``fn`` on CPU and on tpu: the same exception (type and text) or the same result."""
    try:
        want = fn(*args)
    except (RuntimeError, NotImplementedError) as e:
        want = e
    tpu = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]
    if isinstance(want, Exception):
        with pytest.raises(type(want)) as got:
            fn(*tpu)
        assert str(got.value).split(" (in aten::")[0] == str(want)
        return True
    torch.testing.assert_close(fn(*tpu).cpu(), want, equal_nan=True)
    return False


@pytest.mark.parametrize("name", sorted(MIXED_BINARY))
def test_mixed_dtypes_refused_by_their_common_dtype(name):
    fn = MIXED_BINARY[name]
    ran = 0
    for a in _INTEGRAL:
        for b in _INTEGRAL:
            if a == b:
                continue
            for shapes in [((3,), (3,)), ((3,), ()), ((), (3,))]:
                x, y = _values(a, shapes[0]), _values(b, shapes[1])
                _same_outcome(fn, x, y)
                ran += 1
    assert ran == 90


@pytest.mark.parametrize(
    "dtypes", [(torch.int8, torch.int16), (torch.bool, torch.uint8), (torch.uint8, torch.int8)]
)
def test_hypot_of_mixed_integers_refused(dtypes):
    x, y = torch.tensor([3, 5], dtype=dtypes[0]), torch.tensor([4, 12], dtype=dtypes[1])
    assert _same_outcome(torch.hypot, x, y)
    # out= and in-place: refused alike, or, where the promoted dtype does not cast to the
    # written tensor (a bool one), CPU's cast check answers first.
    for dtype in (torch.result_type(x, y), torch.bool):
        out = torch.empty(2, dtype=dtype)
        assert _same_outcome(lambda x, y, out: torch.hypot(x, y, out=out), x, y, out)
    assert _same_outcome(lambda x, y: x.clone().hypot_(y), x, y)
    assert _same_outcome(lambda x, y: y.clone().hypot_(x), x, y)


# Python numbers reach other overloads (``remainder.Scalar``, ``clamp_min.default``,
# ``__lshift__.Scalar``) or stand in a Tensor argument (``t // True``); CPU reads them in
# the call's dtype (Note [Python numbers in binary ops]).
_B = torch.tensor([True, False, True])


def _inplace(method, *rest):
    return lambda t: getattr(t.clone(), method)(*rest)


NUMBER_FORMS = {
    "floordiv": lambda t: t // True,
    "rfloordiv": lambda t: True // t,
    "floor_divide_number_self": lambda t: torch.floor_divide(True, t),
    "floor_divide_": _inplace("floor_divide_", True),
    "div_floor": lambda t: torch.div(t, True, rounding_mode="floor"),
    "clamp_min": lambda t: t.clamp_min(True),
    "clamp_max": lambda t: t.clamp_max(True),
    "clamp_min_": _inplace("clamp_min_", True),
    "clamp_max_": _inplace("clamp_max_", False),
    "clamp_min_out": lambda t: torch.clamp_min(t, True, out=torch.empty_like(t)),
    "rpow": lambda t: True**t,
    "pow_number_self": lambda t: torch.pow(False, t),
    "lshift": lambda t: t << True,
    "rshift": lambda t: t >> True,
    "lshift_tensor": lambda t: t << t,
    "rshift_tensor": lambda t: t >> t,
    "ilshift": _inplace("__ilshift__", True),
    "irshift": _inplace("__irshift__", True),
    "bitwise_left_shift_number_self": lambda t: torch.bitwise_left_shift(True, t),
    "bitwise_right_shift_number_other": lambda t: torch.bitwise_right_shift(t, True),
    "mod": lambda t: t % True,
    "rmod": lambda t: True % t,
    "fmod": lambda t: torch.fmod(t, True),
}
# The same calls with a number of a higher kind run on CPU (int64, or float), and these
# special cases: ``t ** True`` copies, ``1 ** t`` fills ones.
NUMBER_FORMS_ACCEPTED = {
    "floordiv_int": lambda t: t // 2,
    "clamp_min_int": lambda t: t.clamp_min(1),
    "clamp_max_float": lambda t: t.clamp_max(0.5),
    "rpow_int": lambda t: 2**t,
    "pow_true": lambda t: t**True,
    "pow_one": lambda t: torch.pow(1, t),
    "lshift_int": lambda t: t << 1,
    "rshift_int": lambda t: t >> 1,
    "mod_int": lambda t: t % 2,
    "bitwise_left_shift_int": lambda t: torch.bitwise_left_shift(2, t),
}


def test_bool_with_python_numbers_match_cpu():
    """Every form of NUMBER_FORMS refused as on CPU; NUMBER_FORMS_ACCEPTED's run."""
    refused = [name for name, fn in NUMBER_FORMS.items() if _same_outcome(fn, _B)]
    assert refused == list(NUMBER_FORMS)
    accepted = [n for n, fn in NUMBER_FORMS_ACCEPTED.items() if not _same_outcome(fn, _B)]
    assert accepted == list(NUMBER_FORMS_ACCEPTED)


@pytest.mark.parametrize("dtype", _INTEGRAL[1:], ids=str)
def test_integers_with_python_numbers_match_cpu(dtype):
    """hypot of an int8 tensor and 2 refuses 'Char' (2 promotes into int8); the integer
    calls of NUMBER_FORMS run as on CPU."""
    t = _values(dtype, (3,))
    assert _same_outcome(lambda t: torch.hypot(t, torch.tensor(2)), t)
    assert _same_outcome(lambda t: torch.logaddexp(t, torch.tensor(2)), t)
    ran = 0
    for name, fn in NUMBER_FORMS.items():
        if name not in ("rpow", "pow_number_self"):  # True ** int_t is int
            _same_outcome(fn, t)
            ran += 1
    assert ran == len(NUMBER_FORMS) - 2


# The calls reported refused on CPU and answered on tpu: softmax of int64 gave zeros.
REPORTED = {
    "softmax_int64": (lambda x: F.softmax(x, 0), torch.arange(4)),
    "softmax_int64_2d": (lambda x: F.softmax(x, -1), torch.arange(6).view(2, 3)),
    "softmax_bool": (lambda x: F.softmax(x, 0), torch.tensor([True, False, True])),
    "log_softmax_int64": (lambda x: F.log_softmax(x, 0), torch.arange(4)),
    "gelu_int64": (lambda x: F.gelu(x), torch.arange(4)),
    "layer_norm_int64": (lambda x: F.layer_norm(x, (4,)), torch.arange(8).view(2, 4)),
    "mse_loss_int64": (lambda x: F.mse_loss(x, x + 1), torch.arange(4)),
    "mse_loss_int32": (lambda x: F.mse_loss(x, x + 1), torch.arange(4, dtype=torch.int32)),
    "mse_loss_uint8": (lambda x: F.mse_loss(x, x + 1), torch.arange(4, dtype=torch.uint8)),
}


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_reported_refusals(name):
    fn, x = REPORTED[name]
    want = _outcome(fn, x)
    assert want is not None and want[0] is NotImplementedError
    assert _outcome(fn, x.to("tpu")) == want


# Where a refusal stops: each op refuses the first call, as CPU does, and runs the second,
# which CPU accepts though the table lists its overload: the refusal needs every listed
# argument in the dtype (nll_loss's Long target is no refusal), a value (div's
# rounding_mode), a shape CPU's kernel answers before its dtype dispatch (empty, 0-dim).
LIMITS = {
    "cross_entropy": (
        lambda x, t: F.cross_entropy(x, t),
        (torch.arange(12).view(3, 4), torch.tensor([0, 3, 1])),
        (torch.randn(3, 4), torch.tensor([0, 3, 1])),
    ),
    "div_rounding_mode": (
        lambda x, mode: torch.div(x, x, rounding_mode=mode),
        (torch.tensor([True, False]), "trunc"),
        (torch.tensor([True, False]), None),
    ),
    "softmax_empty": (
        lambda x: F.softmax(x, 0),
        (torch.arange(4),),
        (torch.zeros(0, dtype=torch.long),),
    ),
    "cummax_0dim": (
        lambda x: torch.cummax(x, 0),
        (torch.tensor([1 + 2j, 3j]),),
        (torch.tensor(1 + 2j),),
    ),
    "mse_loss_float": (
        lambda x: F.mse_loss(x, x + 1),
        (torch.arange(4),),
        (torch.arange(4.0),),
    ),
}


def _tpu(args):
    return [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_refusal_limits(name):
    fn, refused, accepted = LIMITS[name]
    want = _outcome(fn, *refused)
    assert want is not None
    assert _outcome(fn, *_tpu(refused)) == want
    expected, got = fn(*accepted), fn(*_tpu(accepted))
    torch.testing.assert_close(
        [g.cpu() for g in got] if isinstance(got, tuple) else got.cpu(),
        list(expected) if isinstance(expected, tuple) else expected,
        equal_nan=True,
    )


# Complex inputs (x complex; the other arguments as the op needs them).
COMPLEX_CALLS = {
    "round": lambda x: torch.round(x),
    "round.decimals": lambda x: torch.round(x, decimals=2),
    "ceil": lambda x: torch.ceil(x),
    "floor": lambda x: torch.floor(x),
    "trunc": lambda x: torch.trunc(x),
    "frac": lambda x: torch.frac(x),
    "sign": lambda x: torch.sign(x),
    "signbit": lambda x: torch.signbit(x),
    "lgamma": lambda x: torch.lgamma(x),
    "digamma": lambda x: torch.digamma(x),
    "erf": lambda x: torch.erf(x),
    "erfc": lambda x: torch.erfc(x),
    "erfinv": lambda x: torch.erfinv(x),
    "i0": lambda x: torch.i0(x),
    "logit": lambda x: torch.logit(x),
    "heaviside": lambda x: torch.heaviside(x, x),
    "hypot": lambda x: torch.hypot(x, x),
    "atan2": lambda x: torch.atan2(x, x),
    "copysign": lambda x: torch.copysign(x, x),
    "nextafter": lambda x: torch.nextafter(x, x),
    "xlogy": lambda x: torch.xlogy(x, x),
    "igamma": lambda x: torch.igamma(x, x),
    "igammac": lambda x: torch.igammac(x, x),
    "rad2deg": lambda x: torch.rad2deg(x),
    "deg2rad": lambda x: torch.deg2rad(x),
    "max.default": lambda x: torch.max(x),
    "max.dim": lambda x: torch.max(x, 0),
    "min.default": lambda x: torch.min(x),
    "amax": lambda x: torch.amax(x),
    "amin": lambda x: torch.amin(x),
    "aminmax": lambda x: torch.aminmax(x),
    "kthvalue": lambda x: torch.kthvalue(x, 1),
    "median": lambda x: torch.median(x),
    "nanmedian": lambda x: torch.nanmedian(x),
    "mode": lambda x: torch.mode(x),
    "bucketize": lambda x: torch.bucketize(x, x),
    "searchsorted": lambda x: torch.searchsorted(x, x),
}
# In-place, out= and foreach forms reach the entries of the functional overloads.
COMPLEX_FORMS = {
    "round_": lambda x: x.round_(),
    "erf_out": lambda x: torch.erf(x, out=torch.empty_like(x)),
    "atan2_": lambda x: x.atan2_(x),
    "foreach_round": lambda x: torch._foreach_round([x]),
    "foreach_max": lambda x: torch._foreach_max([x]),
    "foreach_maximum_scalars": lambda x: torch._foreach_maximum([x], [1.0]),
    "foreach_clamp_min_scalar": lambda x: torch._foreach_clamp_min([x], 0.5),
    "foreach_erf": lambda x: torch._foreach_erf([x]),
}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("name", sorted(COMPLEX_CALLS) + sorted(COMPLEX_FORMS))
def test_complex_refused_as_cpu(name, dtype):
    fn = COMPLEX_CALLS.get(name) or COMPLEX_FORMS[name]
    x = torch.tensor([1.5 - 0.5j, -2.0 + 1.0j, 0.25j], dtype=dtype)
    want = _outcome(fn, x.clone())
    assert want is not None, f"CPU accepts {name}"
    assert _outcome(fn, x.to("tpu")) == want


@pytest.mark.parametrize("name", sorted(COMPLEX_CALLS))
def test_real_inputs_still_run(name):
    x = torch.tensor([1.5, 0.5, 0.25])
    want = COMPLEX_CALLS[name](x)
    got = COMPLEX_CALLS[name](x.to("tpu"))
    torch.testing.assert_close(
        [g.cpu() for g in got] if isinstance(got, tuple) else got.cpu(),
        list(want) if isinstance(want, tuple) else want,
        equal_nan=True,
    )


# Refusals made inside CPU's composite kernels or by ATen's own argument checks, which
# the op_db survey does not see; each compared with CPU on the same call.
_HAND_CHECKED = {
    "dropout": lambda d, dt: F.dropout(torch.ones(4, dtype=dt, device=d), 0.5),
    "soft_margin_loss": lambda d, dt: F.soft_margin_loss(
        torch.ones(3, dtype=dt, device=d), torch.ones(3, dtype=dt, device=d)
    ),
    "embedding_bag": lambda d, dt: F.embedding_bag(
        torch.tensor([0, 1], device=d),
        torch.arange(6, device=d).reshape(2, 3).to(dt),
        torch.tensor([0], device=d),
    ),
    "polar": lambda d, dt: torch.polar(
        torch.ones(2, dtype=dt, device=d), torch.zeros(2, dtype=dt, device=d)
    ),
    "randint_like": lambda d, dt: torch.randint_like(torch.zeros(3, dtype=dt, device=d), 300),
    "random_.from": lambda d, dt: torch.zeros(3, dtype=dt, device=d).random_(-1, 2),
    "random_.to": lambda d, dt: torch.zeros(3, dtype=dt, device=d).random_(200),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool])
@pytest.mark.parametrize("op", list(_HAND_CHECKED))
def test_refusals_inside_composites_and_argument_checks_match_cpu(op, dtype):
    def outcome(device):
        try:
            out = _HAND_CHECKED[op](device, dtype)
        except (RuntimeError, NotImplementedError) as e:
            return type(e), str(e)
        return None, out.dtype

    want, got = outcome("cpu"), outcome("tpu")
    assert got[0] is want[0], (got, want)
    if want[0] is None:
        assert got[1] == want[1]
    elif op != "soft_margin_loss" or dtype != torch.bool:  # neg's text, its op named first
        assert got[1].startswith(want[1]), (got, want)


@pytest.mark.parametrize(
    "dtype,lo,hi",
    [(torch.float16, 0, 5000), (torch.bfloat16, -300, 0), (torch.float32, 0, 2**25)],
)
def test_random_bounds_past_exact_integers_warn_as_cpu(dtype, lo, hi):
    with pytest.warns(UserWarning, match="out of bounds") as cpu:
        torch.zeros(3, dtype=dtype).random_(lo, hi)
    with pytest.warns(UserWarning, match="out of bounds") as tpu:
        out = torch.zeros(3, dtype=dtype, device="tpu").random_(lo, hi)
    texts = [str(w.message) for w in cpu if "out of bounds" in str(w.message)]
    ours = [str(w.message) for w in tpu if "out of bounds" in str(w.message)]
    # CPU's ends with where in ATen it was triggered.
    assert len(texts) == len(ours) == 1 and texts[0].startswith(ours[0])
    assert lo <= out.cpu().min().item() and out.cpu().max().item() < hi
