"""torchjax/ops/dtype_refusals.py: complex tensors refused where torch refuses them, with
torch's exception type and message, for every entry of the table."""

import pytest
import torch

import torchjax  # noqa: F401
from torchjax.ops.dtype_refusals import REFUSED_COMPLEX

# One call per table entry (x complex; the other arguments as the op needs them).
CALLS = {
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
# In-place and foreach forms reach the same entries.
EXTRA = {
    "round_": lambda x: x.round_(),
    "erf_out": lambda x: torch.erf(x, out=torch.empty_like(x)),
    "atan2_": lambda x: x.atan2_(x),
    "foreach_round": lambda x: torch._foreach_round([x]),
    "foreach_max": lambda x: torch._foreach_max([x]),
    "foreach_maximum_scalars": lambda x: torch._foreach_maximum([x], [1.0]),
    "foreach_clamp_min_scalar": lambda x: torch._foreach_clamp_min([x], 0.5),
    "foreach_erf": lambda x: torch._foreach_erf([x]),
}


def _outcome(fn, x):
    try:
        fn(x)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e), str(e).split(" (in aten::")[0]
    return None


def test_every_entry_has_a_call():
    assert sorted(CALLS) == sorted(REFUSED_COMPLEX)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("name", sorted(CALLS) + sorted(EXTRA))
def test_complex_refused_as_cpu(name, dtype):
    fn = CALLS.get(name) or EXTRA[name]
    x = torch.tensor([1.5 - 0.5j, -2.0 + 1.0j, 0.25j], dtype=dtype)
    want = _outcome(fn, x.clone())
    assert want is not None, f"CPU accepts {name}: the entry is wrong"
    got = _outcome(fn, x.to("tpu"))
    assert got == want


@pytest.mark.parametrize("name", sorted(CALLS))
def test_real_inputs_still_run(name):
    x = torch.tensor([1.5, 0.5, 0.25])
    want = CALLS[name](x)
    got = CALLS[name](x.to("tpu"))
    torch.testing.assert_close(
        [g.cpu() for g in got] if isinstance(got, tuple) else got.cpu(),
        list(want) if isinstance(want, tuple) else want,
        equal_nan=True,
    )
