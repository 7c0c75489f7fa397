"""Tests for torchjax/ops/factory.py: arange, linspace, logspace, eye, *_like, new_*,
tril/triu_indices, scalar_tensor, torch.tensor and default dtype/device handling."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

import torchjax
from torchjax.testing import opinfo as oi

# Factory OpInfos pass device="cpu" (and the *_like/new_* ones sometimes too), which the
# standard harness (tests/ops/opinfo_cases.py) would keep on CPU; this sweep swaps
# device="cpu" for "tpu", moves tensor inputs to tpu, and runs the out= variant.
FACTORY_OPS = [
    "arange",
    "linspace",
    "linspace.tensor_overload",
    "logspace",
    "logspace.tensor_overload",
    "eye",
    "full",
    "zeros",
    "ones",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
    "full_like",
    "zeros_like",
    "ones_like",
    "new_full",
    "new_zeros",
    "new_ones",
]
# Uninitialised results: compared on shape, dtype and device only.
EMPTY_OPS = [
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "new_empty_strided",
    "empty_permuted",
]
_SAMPLES = 24


def _factory_cases(names=FACTORY_OPS):
    cases = []
    for op in oi.opinfos(names):
        supported = op.supported_dtypes("cpu")
        for dtype in oi.DTYPES:
            if dtype in supported:
                cases.append(pytest.param(op, dtype, id=f"{oi.full_name(op)}-{dtype}"))
    return cases


def _on_tpu(x):
    if isinstance(x, torch.Tensor):
        return x.to("tpu")
    return "tpu" if x == "cpu" else x


def _tpu_sample(s):
    inp = tree_map(_on_tpu, s.input) if isinstance(s.input, torch.Tensor) else s.input
    args = tree_map(lambda a: a.to("tpu") if isinstance(a, torch.Tensor) else a, s.args)
    kwargs = dict(s.kwargs)
    if "device" in kwargs:
        kwargs["device"] = "tpu"
    return inp, args, kwargs


@pytest.mark.parametrize("op,dtype", _factory_cases())
def test_factory_opinfo(op, dtype):
    fn = op.get_op()
    for s in oi.samples(op, dtype, limit=_SAMPLES):
        expected = fn(s.input, *s.args, **s.kwargs)
        inp, args, kwargs = _tpu_sample(s)
        got = fn(inp, *args, **kwargs)
        oi.compare(got, expected, f"{oi.full_name(op)} forward")
        if op.supports_out:
            kwargs.pop("device", None)
            kwargs.pop("requires_grad", None)
            kwargs.pop("dtype", None)
            out = torch.empty(0, dtype=expected.dtype, device="tpu")
            got = fn(inp, *args, **kwargs, out=out)
            assert got is out
            oi.compare(out, expected, f"{oi.full_name(op)} out=")


@pytest.mark.parametrize("op,dtype", _factory_cases(EMPTY_OPS))
def test_empty_opinfo(op, dtype):
    fn = op.get_op()
    for s in oi.samples(op, dtype, limit=_SAMPLES):
        expected = fn(s.input, *s.args, **s.kwargs)
        inp, args, kwargs = _tpu_sample(s)
        got = fn(inp, *args, **kwargs)
        assert got.device.type == "tpu" and got.dtype == expected.dtype
        assert got.shape == expected.shape


# ---------------------------------------------------------------------------------------
# arange


@pytest.mark.parametrize(
    "args", [(5,), (2, 9), (0, 1, 0.1), (10, 0, -3), (-2.5, 2.5, 0.5), (0, 5.5, 1.5), (1, 1)]
)
@pytest.mark.parametrize("dtype", [None, torch.int64, torch.int32, torch.float64, torch.bfloat16])
def test_arange(args, dtype):
    try:
        expected = torch.arange(*args, dtype=dtype)
    except ValueError:  # integer dtype with a step that truncates to 0
        with pytest.raises(ValueError, match="step must be nonzero"):
            torch.arange(*args, dtype=dtype, device="tpu")
        return
    oi.compare(torch.arange(*args, dtype=dtype, device="tpu"), expected)


def test_arange_int64_past_2_31():
    start = 2**40
    got = torch.arange(start, start + 5, device="tpu")
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == list(range(start, start + 5))
    big = 2**53 + 1
    assert torch.arange(big, big + 3, device="tpu").cpu().tolist() == [big, big + 1, big + 2]


def test_arange_out_resize_and_dtype():
    out = torch.empty(0, dtype=torch.float64, device="tpu")
    torch.arange(0, 1, 0.25, out=out)
    oi.compare(out, torch.arange(0, 1, 0.25, dtype=torch.float64))


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0, 5, 0), RuntimeError, "step must be nonzero"),  # as CPU torch
        ((5, 0, 1), RuntimeError, "inconsistent with step"),
    ],
)
def test_arange_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        torch.arange(*args, device="tpu")


def _arange_outcome(args, kwargs):
    try:
        return torch.arange(*args, **kwargs)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        return error


@pytest.mark.parametrize(
    "args",
    [
        (1j,),
        (0, 3j),
        (0, 5, 1j),
        (1j, 5),
        (0, 5, 0j),
        (0, 5 + 1e-300j),
        (complex("nan+nanj"),),
        (0j, 5 + 0j),
        (0, 5, 1 + 0j),
        (0, 1, 0.5 + 0j),
        (5,),
        (0, 5, 0),
    ],  # fmt: skip
    ids=str,
)
@pytest.mark.parametrize(
    "dtype",
    [
        None,
        torch.float32,
        torch.int64,
        torch.float16,
        torch.bool,
        torch.complex64,
        torch.complex128,
    ],  # fmt: skip
    ids=str,
)
def test_arange_complex_and_bool_as_cpu(args, dtype):
    # CPU has real kernels only: a complex or bool dtype is refused first; complex bounds
    # are read as doubles, so an imaginary part raises and a zero one is dropped.
    kwargs = {} if dtype is None else {"dtype": dtype}
    want = _arange_outcome(args, kwargs)
    got = _arange_outcome(args, {**kwargs, "device": "tpu"})
    if isinstance(want, Exception):
        assert type(got) is type(want), (want, got)
        assert str(got).startswith(str(want)), (want, got)
    else:
        oi.compare(got, want)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool], ids=str)
def test_arange_out_of_complex_or_bool_refused_as_cpu(dtype):
    name = "ComplexFloat" if dtype.is_complex else "Bool"
    with pytest.raises(NotImplementedError, match=f"^\"arange_cpu\" not implemented for '{name}'"):
        torch.arange(5, out=torch.empty(0, dtype=dtype, device="tpu"))


def test_arange_default_dtype_float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        oi.compare(torch.arange(0, 1, 0.1, device="tpu"), torch.arange(0, 1, 0.1))
        oi.compare(torch.linspace(0, 1, 7, device="tpu"), torch.linspace(0, 1, 7))
        oi.compare(torch.full((2,), 0.1, device="tpu"), torch.full((2,), 0.1))
        oi.compare(torch.zeros(3, device="tpu"), torch.zeros(3))
        oi.compare(torch.tensor([0.1, 0.2], device="tpu"), torch.tensor([0.1, 0.2]))
        x = torch.ones(2, device="tpu")
        assert x.dtype == torch.float64
        assert x.new_full((2,), 1).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)


# ---------------------------------------------------------------------------------------
# linspace / logspace / eye / tri indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.float16])
@pytest.mark.parametrize(
    "start,end,steps", [(0, 10, 7), (-3.5, 2.25, 11), (5, -5, 4), (1, 1, 1), (0, 1, 0)]
)
def test_linspace_logspace(dtype, start, end, steps):
    oi.compare(
        torch.linspace(start, end, steps, dtype=dtype, device="tpu"),
        torch.linspace(start, end, steps, dtype=dtype),
    )
    oi.compare(
        torch.logspace(start, end, steps, base=2, dtype=dtype, device="tpu"),
        torch.logspace(start, end, steps, base=2, dtype=dtype),
    )


def test_linspace_negative_steps():
    with pytest.raises(RuntimeError, match="number of steps must be non-negative"):
        torch.linspace(0, 1, -1, device="tpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int32])
def test_eye(dtype):
    oi.compare(torch.eye(4, dtype=dtype, device="tpu"), torch.eye(4, dtype=dtype))
    oi.compare(torch.eye(2, 5, dtype=dtype, device="tpu"), torch.eye(2, 5, dtype=dtype))
    out = torch.empty(0, dtype=dtype, device="tpu")
    torch.eye(3, 2, out=out)
    oi.compare(out, torch.eye(3, 2, dtype=dtype))
    with pytest.raises(RuntimeError, match="n must be greater or equal to 0"):
        torch.eye(-1, device="tpu")


@pytest.mark.parametrize("fn", [torch.tril_indices, torch.triu_indices])
@pytest.mark.parametrize("row,col,offset", [(3, 3, 0), (4, 2, 1), (2, 5, -1), (0, 3, 0)])
def test_tri_indices(fn, row, col, offset):
    oi.compare(fn(row, col, offset, device="tpu"), fn(row, col, offset))
    oi.compare(
        fn(row, col, offset, device="tpu", dtype=torch.int32),
        fn(row, col, offset, dtype=torch.int32),
    )


# ---------------------------------------------------------------------------------------
# *_like and new_*


def test_like_dtype_and_device_kwargs():
    x = torch.ones(2, 3, device="tpu")
    for fn in (torch.zeros_like, torch.ones_like, torch.empty_like):
        y = fn(x, dtype=torch.int64)
        assert y.device.type == "tpu" and y.dtype == torch.int64 and y.shape == x.shape
        z = fn(x, device="cpu")
        assert z.device.type == "cpu" and z.dtype == torch.float32 and z.shape == x.shape
    oi.compare(torch.full_like(x, 7, dtype=torch.int32), torch.full((2, 3), 7, dtype=torch.int32))
    oi.compare(torch.zeros_like(x), torch.zeros(2, 3))
    oi.compare(torch.ones_like(x), torch.ones(2, 3))
    y = torch.zeros_like(torch.ones(3, device="cpu"), device="tpu")
    assert y.device.type == "tpu"


def test_empty_like_and_new_empty_shape_dtype():
    x = torch.ones(0, 5, dtype=torch.bfloat16, device="tpu")
    for y in (torch.empty_like(x), x.new_empty((0, 5)), torch.empty_like(x[:, :2])):
        assert y.device.type == "tpu" and y.dtype == torch.bfloat16
    assert torch.empty_like(x).shape == (0, 5)
    assert x.new_empty((2, 3), dtype=torch.int32).dtype == torch.int32


def test_new_factories():
    x = torch.ones(2, dtype=torch.int32, device="tpu")
    oi.compare(x.new_full((3,), 5), torch.full((3,), 5, dtype=torch.int32))
    oi.compare(x.new_zeros((2, 2), dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
    oi.compare(x.new_ones(()), torch.ones((), dtype=torch.int32))
    oi.compare(x.new_tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int32))


def test_scalar_tensor_and_full_dtypes():
    oi.compare(torch.scalar_tensor(3, device="tpu"), torch.scalar_tensor(3))
    oi.compare(
        torch.scalar_tensor(True, dtype=torch.bool, device="tpu"),
        torch.scalar_tensor(True, dtype=torch.bool),
    )
    oi.compare(torch.full((2,), 2**40, device="tpu"), torch.full((2,), 2**40))
    oi.compare(torch.full((2,), True, device="tpu"), torch.full((2,), True))
    oi.compare(
        torch.full((), 1.5, dtype=torch.float16, device="tpu"),
        torch.full((), 1.5, dtype=torch.float16),
    )


# ---------------------------------------------------------------------------------------
# torch.tensor and default device


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_tensor_from_list(dtype):
    data = [[0, 1, 2], [3, 1, 0]]
    oi.compare(torch.tensor(data, dtype=dtype, device="tpu"), torch.tensor(data, dtype=dtype))


def test_tensor_exact_values():
    ints = [2**31, -(2**31) - 1, 2**62 + 1, -(2**63)]
    assert torch.tensor(ints, device="tpu").cpu().tolist() == ints
    floats = [0.1, 1 / 3, 1e300, -5e-324]
    got = torch.tensor(floats, dtype=torch.float64, device="tpu").cpu().tolist()
    assert got == floats
    oi.compare(torch.tensor(1.5, device="tpu"), torch.tensor(1.5))
    oi.compare(torch.tensor([], device="tpu"), torch.tensor([]))


def test_set_default_device():
    try:
        torch.set_default_device("tpu")
        for t in (
            torch.zeros(2),
            torch.ones(2, 2),
            torch.arange(3),
            torch.full((2,), 1.0),
            torch.tensor([1, 2]),
            torch.linspace(0, 1, 3),
            torch.eye(2),
            torch.empty(3),
            torch.rand(2),
            torch.randn(2),
            torch.randint(0, 5, (2,)),
        ):
            assert t.device.type == "tpu", t
        oi.compare(torch.arange(3), torch.arange(3, device="cpu"))
    finally:
        torch.set_default_device(None)
    assert torch.zeros(1).device.type == "cpu"


def test_linspace_reads_its_bounds_as_the_output_type():
    # CPU converts start and end to the output type first, with c10's overflow check:
    # out-of-range bounds raise, a negative bound of an unsigned type wraps.
    checked = 0
    for kwargs in (
        dict(start=0, end=1e6, steps=3, dtype=torch.float16),
        dict(start=0, end=300, steps=3, dtype=torch.int8),
        dict(start=0, end=1e39, steps=3, dtype=torch.float32),
    ):
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.linspace(**kwargs)
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.linspace(**kwargs, device="tpu")
        checked += 1
    for start, end, steps in [(-5, 5, 3), (-200, 250, 7), (3, -7, 5)]:
        want = torch.linspace(start, end, steps, dtype=torch.uint8)
        got = torch.linspace(start, end, steps, dtype=torch.uint8, device="tpu")
        assert torch.equal(got.cpu(), want), (start, end, steps)
        checked += 1
    assert checked == 6


# kaiser_window: Note [kaiser_window on tpu] in torchjax/ops/factory.py.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("args", [(), (False,), (True, 5.0), (False, 0.5)])
@pytest.mark.parametrize("n", [0, 1, 2, 8])
def test_kaiser_window(n, args, dtype):
    got = torch.kaiser_window(n, *args, dtype=dtype, device="tpu")
    want = torch.kaiser_window(n, *args, dtype=dtype)
    oi.compare(got, want)
    assert got.stride() == want.stride()


def test_kaiser_window_default_dtype_and_grad():
    got = torch.kaiser_window(8, requires_grad=True, device="tpu")
    want = torch.kaiser_window(8, requires_grad=True)
    oi.compare(got, want)
    assert got.requires_grad and got.is_leaf


@pytest.mark.parametrize(
    "n,kwargs",
    [(-1, {}), (4, {"dtype": torch.int64}), (4, {"layout": torch.sparse_coo})],
)
@pytest.mark.parametrize("device", ["tpu", "tpu:0"])
def test_kaiser_window_errors(n, kwargs, device):
    with pytest.raises(RuntimeError) as cpu:
        torch.kaiser_window(n, **kwargs)
    want = str(cpu.value).replace("device=cpu", f"device={device}")
    with pytest.raises(RuntimeError) as tpu:
        torch.kaiser_window(n, **kwargs, device=device)
    assert str(tpu.value) == want


@pytest.mark.parametrize(
    "overload,args",
    [("out", (6,)), ("periodic_out", (6, False)), ("beta_out", (5, True, 3.0))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kaiser_window_out(overload, args, dtype):
    op = getattr(torch.ops.aten.kaiser_window, overload)
    got = op(*args, out=torch.empty(0, dtype=dtype, device="tpu"))
    oi.compare(got, op(*args, out=torch.empty(0, dtype=dtype)))


def test_kaiser_window_out_errors():
    with pytest.raises(RuntimeError) as cpu:
        torch.ops.aten.kaiser_window.out(6, out=torch.empty(0, dtype=torch.int64))
    with pytest.raises(RuntimeError) as tpu:
        torch.ops.aten.kaiser_window.out(6, out=torch.empty(0, dtype=torch.int64, device="tpu"))
    assert str(tpu.value) == str(cpu.value).replace("device=cpu", "device=tpu:0")


def test_kaiser_window_compiled():
    def windowed(x):
        return x * torch.kaiser_window(8, False, 5.0, dtype=x.dtype, device=x.device)

    x = torch.randn(3, 8)
    want = windowed(x)
    oi.compare(torchjax.jit(windowed)(x.to("tpu")), want)
    oi.compare(torch.compile(windowed, backend="tpu")(x.to("tpu")), want)
