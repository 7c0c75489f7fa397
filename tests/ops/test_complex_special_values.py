"""Complex unary ops at special values against CPU torch, point by point.

A 13 x 13 grid of real and imaginary parts (NaN, infinities, the largest finite values,
subnormals, signed zeros, ±1, ±1.5) goes through every complex unary op torchjax
lowers, in complex64 and complex128: Note [Complex special values] in
torchjax/ops/complex_math.py. NaNs must sit in the same parts (their sign and payload
are free), zeros must have CPU's sign, other values agree to a few ulps of the
CPU value's larger part.

The reference is CPU's vector kernel: each value is evaluated at the head of a run of
copies, so it lands in a vector lane on any CPU (a tensor's last few elements go through
ATen's scalar loop, which for a few ops computes otherwise). What still differs is
``EXPECTED``: each entry names the ops, the inputs and the cause, and the test checks
that the difference still holds, so the table cannot go stale.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchjax  # noqa: F401
from tests._child import once_per_run

inf, nan = math.inf, math.nan

# Part names, in grid order; each dtype gives them values.
NAMES = [
    "nan",
    "-inf",
    "-huge",
    "-1.5",
    "-1",
    "-tiny",
    "-0",
    "0",
    "tiny",
    "1",
    "1.5",
    "huge",
    "inf",
]
HUGE = {torch.complex64: 3e38, torch.complex128: 1.7e308}
TINY = {torch.complex64: 1e-40, torch.complex128: 1e-310}  # subnormal
# Relative tolerance: glibc and XLA round differently, a few ulps apart.
RTOL = {torch.complex64: 8 * 2.0**-24, torch.complex128: 8 * 2.0**-53}

OPS = {
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "log": torch.log,
    "log2": torch.log2,
    "log10": torch.log10,
    "log1p": torch.log1p,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "expm1": torch.expm1,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "tanh": torch.tanh,
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "sigmoid": torch.sigmoid,
    "reciprocal": torch.reciprocal,
    "sgn": torch.sgn,
    "angle": torch.angle,
    "abs": torch.abs,
    "neg": torch.neg,
    "conj_physical": torch.conj_physical,
    "square": torch.square,
    "silu": torch.nn.functional.silu,
    "sinc": torch.sinc,
    "nan_to_num": torch.nan_to_num,
    "softsign": torch.nn.functional.softsign,
    "positive": torch.positive,
    "conj().imag": lambda z: z.conj().imag.clone(),
    "pow 2": lambda z: z**2,
    "pow 0.5": lambda z: z**0.5,
    "pow -0.5": lambda z: z**-0.5,
    "pow -1": lambda z: z**-1,
    # General powers: std::pow (glibc's cpow); 3 is x*x*x for a Python exponent only.
    "pow 1.5": lambda z: z**1.5,
    "pow 3": lambda z: z**3,
    "pow tensor 3": lambda z: z ** torch.tensor(3, device=z.device),
    # CPU's add kernel multiplies the second operand by alpha (1 + 0j included).
    "rsub": lambda z: 1 - z,
    "tanhshrink": torch.nn.functional.tanhshrink,
}


def _value(name: str, dtype) -> float:
    fixed = {"nan": nan, "inf": inf, "-inf": -inf, "0": 0.0, "-0": -0.0}
    if name in fixed:
        return fixed[name]
    sign = -1.0 if name.startswith("-") else 1.0
    mag = name.lstrip("-")
    return (
        sign * {"huge": HUGE[dtype], "tiny": TINY[dtype]}.get(mag)
        if mag in ("huge", "tiny")
        else float(name)
    )


POINTS = [(re, im) for re in NAMES for im in NAMES]


def _grid(dtype) -> torch.Tensor:
    part = torch.float32 if dtype == torch.complex64 else torch.float64
    re = torch.tensor([_value(a, dtype) for a, _ in POINTS], dtype=part)
    im = torch.tensor([_value(b, dtype) for _, b in POINTS], dtype=part)
    return torch.complex(re, im)


def _cpu_vector_lanes(fn, z: torch.Tensor) -> torch.Tensor:
    # Each value heads a run of 64 copies: a vector lane for any vector width <= 64.
    return fn(z.repeat_interleave(64))[::64].clone()


def _cpu_scalar_loop(fn, z: torch.Tensor) -> torch.Tensor:
    # A one-element tensor is all tail: ATen's scalar loop computes it.
    return torch.stack([fn(z[i : i + 1])[0] for i in range(len(z))])


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormal parts to zeros of their sign, as XLA's CPU and TPU backends store them."""
    if x.is_complex():
        return torch.complex(_flush(x.real), _flush(x.imag))
    tiny = torch.finfo(x.dtype).tiny
    return torch.where(x.abs() < tiny, torch.zeros_like(x).copysign(x), x)


def _same_part(want, got, scale, rtol):
    want = _flush(want)
    nan_ok = want.isnan() == got.isnan()
    both = ~want.isnan() & ~got.isnan()
    close = (want == got) | ((want - got).abs() <= rtol * scale)
    sign_ok = want.signbit() == got.signbit()
    return nan_ok & (~both | (close & sign_ok))


def _same(want, got, rtol) -> torch.Tensor:
    """Per point: True where got is want (NaN where NaN, zeros' signs, values within
    ``rtol`` of the CPU value's larger part: a complex result's error is norm-wise;
    exactly beside an infinite part)."""
    if not want.is_complex():
        return _same_part(want, got, want.abs(), rtol)
    re, im = want.real.abs(), want.imag.abs()
    scale = torch.where(re.isnan(), im, torch.where(im.isnan(), re, torch.maximum(re, im)))
    # Beside an infinite part, exactly (torch.testing compares such complexes exactly).
    scale = torch.where(scale.isinf(), torch.zeros_like(scale), scale)
    real_ok = _same_part(want.real, got.real, scale, rtol)
    return real_ok & _same_part(want.imag, got.imag, scale, rtol)


# Expected differences: (ops, inputs, cause, check, when). ``inputs`` is a predicate on
# (real name, imaginary name). Checks: "scalar" - tpu equals CPU's scalar loop there
# (CPU's vector lanes are what differ); "differs" - tpu still differs from CPU. ``when``:
# "always", or "optimised" for a difference only XLA's default optimisation level makes
# (the suite compiles at level 0: Note [Compile speed in the suite] in tests/conftest.py).
def _zero_part(a, b):
    return "0" in (a, b)


def _huge_by_big(a, b):
    return a in ("-huge", "huge") and b in ("-huge", "huge", "-inf", "inf")


def _subnormal_ratio_reciprocal(a, b):
    return (a, b) in {
        ("-huge", "-1.5"), ("-huge", "-1"), ("-1.5", "huge"), ("-1", "huge"),
        ("1", "-huge"), ("1.5", "-huge"), ("huge", "1"), ("huge", "1.5"),
    }  # fmt: skip


def _subnormal_ratio_rsqrt(a, b):
    return (a, b) in {("-huge", "-1.5"), ("-huge", "-1"), ("huge", "1"), ("huge", "1.5")}


def _subnormal_angle(a, b):
    return a == "huge" and b in ("-1.5", "-1", "1", "1.5")


EXPECTED = [
    (
        ("neg",),
        _zero_part,
        "a +0 part: CPU's vector kernel negates as 0 - z (vec256/vec512 complex neg), so "
        "-(+0) comes out +0; tpu negates (-0), as CPU's scalar loop does",
        "scalar",
        "always",
    ),
    (
        ("square", "pow 2", "pow 3"),
        _huge_by_big,
        "±huge real part beside a ±huge or infinite imaginary one: CPU's vector complex "
        "multiply gives re = a*a - b*b = inf - inf = NaN; optimised XLA contracts it into "
        "fma(a, a, -b*b) = -inf, as the compiler does in CPU's scalar loop",
        "scalar",
        "optimised",
    ),
    (
        ("reciprocal", "pow -1"),
        _subnormal_ratio_reciprocal,
        "one part ±huge, the other ±1 or ±1.5: c10's division forms the ratio d/c (or c/d), "
        "a subnormal, which XLA flushes to zero, so a part CPU gives as a subnormal (or a "
        "zero of one sign) is a zero of the other sign on tpu",
        "differs",
        "always",
    ),
    (
        ("rsqrt", "pow -0.5"),
        _subnormal_ratio_rsqrt,
        "±huge beside ±1 or ±1.5 of the same sign: 1 / sqrt(z) divides by a square root "
        "whose parts' ratio is subnormal; XLA flushes it and a zero part changes sign",
        "differs",
        "always",
    ),
    (
        ("pow 1.5", "pow tensor 3"),
        _subnormal_angle,
        "+huge real part beside ±1 or ±1.5: the angle of clog(z) is subnormal, which XLA "
        "flushes to zero, so the imaginary part of cexp(w * clog(z)) is 0 where CPU's is "
        "finite or infinite",
        "differs",
        "always",
    ),
]
SUBNORMAL_CAUSE = (
    "an input part that is subnormal (±tiny): XLA's CPU and TPU backends flush subnormal "
    "operands and results to zero, so these points are computed at a zero, with "
    "whatever sign the backend keeps; they are left out of the comparison"
)
DTYPES = [torch.complex64, torch.complex128]


def _has_subnormal(a, b):
    return "tiny" in a or "tiny" in b


def _mask(pred) -> torch.Tensor:
    return torch.tensor([pred(a, b) for a, b in POINTS])


def _optimised() -> bool:
    return "xla_backend_optimization_level=0" not in os.environ.get("XLA_FLAGS", "")


def check_grid(name, dtype) -> int:
    """Compare op ``name`` on the grid with CPU; returns how many points it compared."""
    fn, z = OPS[name], _grid(dtype)
    want = _cpu_vector_lanes(fn, z)
    got = fn(z.to("tpu")).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    same = _same(want, got, RTOL[dtype])
    compared = ~_mask(_has_subnormal)
    n = int(compared.sum())
    for ops, pred, cause, check, when in EXPECTED:
        if name not in ops or (when == "optimised" and not _optimised()):
            continue
        where = _mask(pred) & compared
        assert where.any(), f"{name}: no grid point for the entry {cause!r}"
        assert not same[where].any(), (
            f"{name} {dtype}: these points now match CPU, drop them from EXPECTED: "
            f"{[POINTS[i] for i in where.nonzero().flatten().tolist() if same[i]]}"
        )
        if check == "scalar":
            scalar = _cpu_scalar_loop(fn, z)
            assert _same(scalar, got, RTOL[dtype])[where].all(), f"{name}: {cause}"
        compared &= ~where
    bad = (compared & ~same).nonzero().flatten().tolist()
    assert not bad, "\n".join(
        f"{name} {dtype} {POINTS[i]}: cpu {complex(want[i])} tpu {complex(got[i])}" for i in bad
    )
    return n


# The grid runs as user code compiles, at XLA's defaults, in one child process: the
# suite compiles at level 0 with XLA:CPU's older fusion code generator (Note [Compile
# speed in the suite] in tests/conftest.py), which multiplies complex infinities in
# another way (``(huge + huge j) ** 2`` gives -inf + inf j there, CPU and XLA's default
# nan + inf j); at the defaults LLVM also contracts products into FMAs and XLA folds
# constants (``_optimised``).
_GRID = """
import json
from tests.ops.test_complex_special_values import OPS, DTYPES, check_grid
out = {}
for name in OPS:
    for dtype in DTYPES:
        try:
            out[f"{name}|{dtype}"] = ["compared", check_grid(name, dtype)]
        except AssertionError as e:
            out[f"{name}|{dtype}"] = ["failed", str(e)]
print("GRID " + json.dumps(out))
"""


def _grid_at_xla_defaults() -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        flags = flags.replace(flag, "")
    env.pop("XLA_FLAGS", None)
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _GRID], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("GRID ")][-1]
    return json.loads(line[len("GRID ") :])


@pytest.fixture(scope="module")
def grid(request, tmp_path_factory) -> dict:
    return once_per_run(request, tmp_path_factory, "complex_grid", _grid_at_xla_defaults)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_complex_unary_op_matches_cpu_on_the_special_value_grid(name, dtype, grid):
    outcome, detail = grid[f"{name}|{dtype}"]
    assert outcome == "compared", detail
    assert detail == 13 * 13 - (2 * 13 * 2 - 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_parts_are_still_flushed_on_tpu(dtype):
    # SUBNORMAL_CAUSE: the grid leaves subnormal inputs out because XLA flushes them;
    # if a backend stops flushing, this fails and those points should be compared.
    part = torch.float32 if dtype == torch.complex64 else torch.float64
    tiny = torch.tensor([TINY[dtype], -TINY[dtype]], dtype=part)
    flushed = (tiny.to("tpu") * 1).cpu()
    assert torch.equal(flushed, torch.tensor([0.0, -0.0], dtype=part))
    assert torch.equal(flushed.signbit(), tiny.signbit())
    z = _grid(dtype)[_mask(_has_subnormal)]
    assert len(z) == 2 * 13 * 2 - 4
    assert not torch.equal(torch.abs(z), torch.abs(z.to("tpu")).cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_complex_log1p_where_one_plus_z_rounds(dtype):
    # c10's log1p tests ``(1 + x) - 1 == x``; XLA folded that to True, so log1p(1e-19 +
    # 1e-18j) lost its real part and log1p(-0.001 + inf j) was not CPU's NaN.
    points = [complex(1e-19, 1e-18), complex(-0.001, inf), complex(0.1, 1e-18)]
    z = torch.tensor(points, dtype=dtype)
    want, got = torch.log1p(z), torch.log1p(z.to("tpu")).cpu()
    assert _same(want, got, RTOL[dtype]).all(), (want, got)
