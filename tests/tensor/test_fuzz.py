"""Seeded, bounded fuzz over tpu tensors and their views, every answer compared with CPU.

Each case builds a random base tensor and a random chain of views (slice, transpose,
select, expand, diagonal, and per family real/imag/view_as_real or view(dtype)), applies
the same chain on CPU and on tpu, and checks: view metadata; an in-place write through
the view (the base must change as on CPU, or both refuse); deepcopy (values, layout, and
aliasing between views copied in one call); pickle; torch.save / torch.load with every
map_location form and weights_only both ways, in both directions; and ``.to`` round
trips (cpu -> tpu -> cpu, dtype changes, non_blocking). A case collects every mismatch,
so one failing run lists all it found.
"""

from __future__ import annotations

import copy
import io
import pickle
import random

import pytest
import torch

import torchjax  # noqa: F401
from tests.device.test_serialization import MAP_LOCATIONS

# Bounded for CI (well under 60 s together): cases per family; torch.save / torch.load
# (the slow part: 26 loads) on every fourth case.
CASES = {"views": 12, "complex": 6, "real_imag": 6, "view_as_real": 6, "dtype_views": 6}
SAVE_EVERY = 4


def _slice(t, rng):
    if t.dim() == 0:
        return None
    d = rng.randrange(t.dim())
    n = t.shape[d]
    start = rng.randrange(n) if n else 0
    stop = rng.randint(start, n)
    step = rng.choice([1, 1, 2])
    idx = (slice(None),) * d + (slice(start, stop, step),)
    return f"[{':,' * d}{start}:{stop}:{step}]", lambda x: x[idx]


def _transpose(t, rng):
    if t.dim() < 2:
        return None
    a, b = rng.sample(range(t.dim()), 2)
    return f".transpose({a}, {b})", lambda x: x.transpose(a, b)


def _select(t, rng):
    if t.dim() == 0 or 0 in t.shape:
        return None
    d = rng.randrange(t.dim())
    i = rng.randrange(t.shape[d])
    return f".select({d}, {i})", lambda x: x.select(d, i)


def _expand(t, rng):
    d = rng.randint(0, t.dim())
    n = rng.choice([2, 3])
    shape = list(t.shape)
    shape.insert(d, n)
    return f".unsqueeze({d}).expand({shape})", lambda x: x.unsqueeze(d).expand(shape)


def _diagonal(t, rng):
    if t.dim() < 2:
        return None
    a, b = rng.sample(range(t.dim()), 2)
    off = rng.choice([-1, 0, 0, 1])
    return f".diagonal({off}, {a}, {b})", lambda x: x.diagonal(off, a, b)


def _real(t, rng):
    if not t.is_complex():
        return None
    part = rng.choice(["real", "imag"])
    return f".{part}", lambda x: getattr(x, part)


def _view_as_real(t, rng):
    if not t.is_complex():
        return None
    return "view_as_real", torch.view_as_real


# Same-size dtype views, and size-changing ones (torch checks the last dimension).
_DTYPE_VIEWS = {
    torch.float32: [torch.int32, torch.complex64, torch.int16],
    torch.int32: [torch.float32],
    torch.complex64: [torch.float32, torch.float64],
    torch.float64: [torch.int64, torch.complex64],
    torch.int64: [torch.float64],
    torch.int16: [torch.float32],
}


def _view_dtype(t, rng):
    choices = _DTYPE_VIEWS.get(t.dtype)
    if not choices:
        return None
    dt = rng.choice(choices)
    return f".view({dt})", lambda x: x.view(dt)


_COMMON = [_slice, _slice, _transpose, _select, _expand, _diagonal]
FAMILIES = {
    "views": (_COMMON, [torch.float32, torch.int64, torch.float64]),
    "complex": (_COMMON, [torch.complex64]),
    "real_imag": (_COMMON + [_real, _real, _real], [torch.complex64]),
    "view_as_real": (_COMMON + [_view_as_real, _view_as_real], [torch.complex64]),
    "dtype_views": (_COMMON + [_view_dtype, _view_dtype], [torch.float32, torch.complex64]),
}


def _base(rng, dtype, shape=None):
    if shape is None:
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=g)
    bound = min(2**40, torch.iinfo(dtype).max)
    return torch.randint(-bound, bound, shape, dtype=dtype, generator=g)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN payloads from dtype views compare equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
    return torch.equal(a, b)


def _layout(stride, shape):
    """Strides that mean something: none for an empty tensor, none of size-1 dims
    (torch's own contiguity checks ignore both)."""
    if 0 in shape:
        return ()
    return tuple(st for st, n in zip(stride, shape) if n != 1)


def _meta(t):
    offset = t.storage_offset() if t.numel() else 0
    return (tuple(t.shape), _layout(t.stride(), t.shape), offset, t.dtype)


class Case:
    def __init__(self, family: str, seed: int):
        self.rng = random.Random(f"{family}-{seed}")
        steps, dtypes = FAMILIES[family]
        self.cpu_base = _base(self.rng, self.rng.choice(dtypes))
        self.tpu_base = self.cpu_base.to("tpu")
        self.chain, self.cpu, self.tpu = [], self.cpu_base, self.tpu_base
        self.errors: list[str] = []
        for _ in range(self.rng.randint(1, 4)):
            step = self.rng.choice(steps)(self.cpu, self.rng)
            if step is None:
                continue
            name, fn = step
            try:
                cpu = fn(self.cpu)
            except RuntimeError:
                self._expect_refusal(name, fn, self.tpu)
                break
            try:
                tpu = fn(self.tpu)
            except Exception as e:  # noqa: BLE001  (any error is the finding)
                self.fail(f"{name}: CPU gives a view, tpu raised {type(e).__name__}: {e}")
                break
            self.chain.append(name)
            self.cpu, self.tpu = cpu, tpu
            if _meta(cpu) != _meta(tpu):
                self.fail(f"metadata: CPU {_meta(cpu)} tpu {_meta(tpu)}")

    def fail(self, msg):
        self.errors.append(
            f"{self.cpu_base.dtype}{list(self.cpu_base.shape)}{''.join(self.chain)}: {msg}"
        )

    def _expect_refusal(self, name, fn, tpu):
        try:
            fn(tpu)
        except RuntimeError:
            return
        except Exception as e:  # noqa: BLE001
            self.fail(f"{name}: CPU raises RuntimeError, tpu {type(e).__name__}: {e}")
            return
        self.fail(f"{name}: CPU raises RuntimeError, tpu accepts it")

    def check_value(self, what, cpu, tpu):
        if not isinstance(tpu, torch.Tensor) or not _same(cpu, tpu.cpu()):
            self.fail(f"{what}: values/dtype differ from CPU")


def _write(case: Case):
    rng = case.rng
    cpu, tpu = case.cpu, case.tpu
    kind = rng.choice(["fill_", "add_", "copy_", "mul_"])
    if kind == "copy_":
        src = _base(rng, cpu.dtype, list(cpu.shape))
        ops = (lambda v: v.copy_(src), lambda v: v.copy_(src.to("tpu")))
    elif kind == "fill_":
        val = 3 if not (cpu.dtype.is_floating_point or cpu.dtype.is_complex) else -2.5
        ops = (lambda v: v.fill_(val),) * 2
    elif kind == "add_":
        ops = (lambda v: v.add_(1),) * 2
    else:
        ops = (lambda v: v.mul_(2),) * 2
    try:
        ops[0](cpu)
    except RuntimeError:
        case._expect_refusal(kind, ops[1], tpu)
        return
    try:
        ops[1](tpu)
    except Exception as e:  # noqa: BLE001
        case.fail(f"{kind} through the view: tpu raised {type(e).__name__}: {e}")
        return
    case.check_value(f"view after {kind}", cpu, tpu)
    case.check_value(f"base after {kind} through the view", case.cpu_base, case.tpu_base)


def _deepcopy(case: Case):
    cpu_b, cpu_v = copy.deepcopy([case.cpu_base, case.cpu])
    tpu_b, tpu_v = copy.deepcopy([case.tpu_base, case.tpu])
    if _meta(cpu_v) != _meta(tpu_v):
        case.fail(f"deepcopy metadata: CPU {_meta(cpu_v)} tpu {_meta(tpu_v)}")
    case.check_value("deepcopy", cpu_v, tpu_v)
    try:
        cpu_b.view(-1)[0] = 1
    except RuntimeError:
        return
    tpu_b.view(-1)[0] = 1
    case.check_value("deepcopied view after writing its deepcopied base", cpu_v, tpu_v)
    case.check_value("original base after writing a deepcopy", case.cpu_base, case.tpu_base)


def _pickle(case: Case):
    back = pickle.loads(pickle.dumps(case.tpu))
    if back.device.type != "tpu":
        case.fail(f"pickle: came back on {back.device}")
    case.check_value("pickle", case.cpu, back)


def _load(buf: io.BytesIO, **kw):
    buf.seek(0)
    return torch.load(buf, **kw)


def _save_load(case: Case):
    cpu_buf, tpu_buf = io.BytesIO(), io.BytesIO()
    # torch refuses to save views of one storage as different dtypes together.
    same = case.cpu.dtype == case.cpu_base.dtype
    torch.save({"base": case.cpu_base, "v": case.cpu} if same else {"v": case.cpu}, cpu_buf)
    torch.save({"base": case.tpu_base, "v": case.tpu} if same else {"v": case.tpu}, tpu_buf)
    for wo in (True, False):
        for form, ml in MAP_LOCATIONS.items():
            # A CPU checkpoint onto tpu: layout and aliasing as on CPU.
            d = _load(cpu_buf, map_location=ml, weights_only=wo)
            where = f"torch.load(cpu file, map_location={form}, weights_only={wo})"
            if d["v"].device.type != "tpu" or _meta(d["v"]) != _meta(case.cpu):
                case.fail(f"{where}: {d['v'].device} {_meta(d['v'])} vs {_meta(case.cpu)}")
            case.check_value(where, case.cpu, d["v"])
            if form == "callable":
                continue  # torch refuses callables for device tensors saved as CPU copies
            d = _load(tpu_buf, map_location=ml, weights_only=wo)
            case.check_value(
                f"torch.load(tpu file, map_location={form}, weights_only={wo})", case.cpu, d["v"]
            )
        d = _load(tpu_buf, map_location="cpu", weights_only=wo)
        if d["v"].device.type != "cpu":
            case.fail("torch.load(tpu file, map_location='cpu') is not on cpu")
        case.check_value(
            f"torch.load(tpu file, map_location='cpu', weights_only={wo})", case.cpu, d["v"]
        )
        case.check_value(
            f"torch.load(tpu file, weights_only={wo})",
            case.cpu,
            _load(tpu_buf, weights_only=wo)["v"],
        )


def _round_trips(case: Case):
    cpu, tpu = case.cpu, case.tpu
    back = tpu.cpu()
    want = cpu.clone(memory_format=torch.preserve_format)
    if _layout(back.stride(), back.shape) != _layout(want.stride(), want.shape):
        case.fail(f".cpu() strides {back.stride()} vs CPU copy {want.stride()}")
    case.check_value(".cpu()", cpu, back)
    moved = cpu.to("tpu", non_blocking=True)
    if _layout(moved.stride(), moved.shape) != _layout(want.stride(), want.shape):
        case.fail(f".to('tpu') strides {moved.stride()} vs CPU copy {want.stride()}")
    case.check_value(".to('tpu', non_blocking=True)", cpu, moved)
    case.check_value("cpu -> tpu -> cpu", cpu, cpu.to("tpu").to("cpu"))
    for dt in (torch.float64, torch.float16, torch.int32):
        if cpu.is_complex() and not dt.is_complex:
            continue  # a warning and a dropped imaginary part on CPU too; not a round trip
        case.check_value(f".to({dt})", cpu.to(dt), tpu.to(dt))
        case.check_value(f".to('cpu', {dt})", cpu.to(dt), tpu.to("cpu", dt))


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_views_copies_and_serialization(family):
    errors = []
    for seed in range(CASES[family]):
        case = Case(family, seed)
        for check in (_deepcopy, _pickle, _round_trips):
            check(case)
        if seed % SAVE_EVERY == 0:
            _save_load(case)
        _write(case)  # last: it changes the base
        errors += case.errors
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors[:40])
