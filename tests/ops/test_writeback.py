"""out= and in-place writes follow torch's checks (Note [out= checks] in
torchjax/ops/writeback.py): dtype refusals, resizing with torch's warning, tuple outputs,
overlapping memory. Each case runs on CPU and on "tpu"."""

import re
import warnings

import pytest
import torch

import torchjax


def _e(dev, *shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=dev)


def _t(dev, values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=dev)


def _sort(dev, vdt, idt):
    v, i = _e(dev, 3, dtype=vdt), _e(dev, 3, dtype=idt)
    torch.sort(_t(dev, [3.0, 1, 2]), out=(v, i))
    return v, i


def _frexp(dev, mdt, edt):
    m, e = _e(dev, 3, dtype=mdt), _e(dev, 3, dtype=edt)
    torch.frexp(_t(dev, [3.0, -0.5, 8]), out=(m, e))
    return m, e


def _topk(dev, vdt):
    v, i = _e(dev, 2, dtype=vdt), _e(dev, 2, dtype=torch.long)
    torch.topk(_t(dev, [3.0, 1, 2]), 2, out=(v, i))
    return v, i


def _max_dim(dev, vdt, idt):
    v, i = _e(dev, 5, dtype=vdt), _e(dev, 0, dtype=idt)
    torch.max(_t(dev, [[3.0, 1], [2, 5]]), 1, out=(v, i))
    return v, i


def _eigh(dev, wdt):
    w, v = _e(dev, 2, dtype=wdt), _e(dev, 2, 2)
    torch.linalg.eigh(_t(dev, [[2.0, 1], [1, 3]]), out=(w, v))
    return w, v.abs()


def _kthvalue(dev, idt):
    v, i = _e(dev, ()), _e(dev, (), dtype=idt)
    torch.kthvalue(_t(dev, [3.0, 1, 2]), 2, out=(v, i))
    return v, i


CASES = {
    "nonzero_float_out": lambda d: torch.nonzero(_t(d, [1, 0, 2]), out=_e(d, 0)),
    "nonzero_long_out": lambda d: torch.nonzero(_t(d, [1, 0, 2]), out=_e(d, 0, dtype=torch.long)),
    "maximum_bool_out": lambda d: torch.maximum(
        _t(d, [1.0]), _t(d, [2.0]), out=_e(d, 1, dtype=torch.bool)
    ),
    "abs_long_out": lambda d: torch.abs(_t(d, [-1.0, 2]), out=_e(d, 2, dtype=torch.long)),
    "mm_double_out": lambda d: torch.mm(
        _t(d, [[1.0]]), _t(d, [[2.0]]), out=_e(d, 1, 1, dtype=torch.float64)
    ),
    "argmax_float_out": lambda d: torch.argmax(_t(d, [1.0, 3, 2]), out=_e(d, ())),
    "cumsum_into_long": lambda d: torch.cumsum(
        _t(d, [1.5, 2, 3]), 0, out=_e(d, 3, dtype=torch.long)
    ),
    "add_into_double": lambda d: torch.add(_t(d, [1.0, 2]), 1, out=_e(d, 2, dtype=torch.float64)),
    "sort_ok": lambda d: _sort(d, torch.float32, torch.long),
    "sort_int32_indices": lambda d: _sort(d, torch.float32, torch.int32),
    "sort_long_values": lambda d: _sort(d, torch.long, torch.long),
    "frexp_ok": lambda d: _frexp(d, torch.float32, torch.int32),
    "frexp_long_exponent": lambda d: _frexp(d, torch.float32, torch.long),
    "topk_ok": lambda d: _topk(d, torch.float32),
    "topk_double_values": lambda d: _topk(d, torch.float64),
    "max_dim_resized": lambda d: _max_dim(d, torch.float32, torch.long),
    "max_dim_double_values": lambda d: _max_dim(d, torch.float64, torch.long),
    "eigh_ok": lambda d: _eigh(d, torch.float32),
    "eigh_long_eigenvalues": lambda d: _eigh(d, torch.long),
    "kthvalue_int32_indices": lambda d: _kthvalue(d, torch.int32),
    "kthvalue_ok": lambda d: _kthvalue(d, torch.long),
}


def _run(case, dev):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = CASES[case](dev)
        except RuntimeError as error:
            return error, []
    return result, [str(w.message)[:40] for w in caught if "resized" in str(w.message)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_out_matches_cpu(case):
    cpu, cpu_warnings = _run(case, "cpu")
    tpu, tpu_warnings = _run(case, "tpu")
    if isinstance(cpu, Exception):
        assert type(tpu) is type(cpu), f"CPU raised {cpu!r}, tpu gave {tpu!r}"
        return
    assert not isinstance(tpu, Exception), f"CPU accepted, tpu raised {tpu!r}"
    assert tpu_warnings == cpu_warnings
    cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    tpu = tpu if isinstance(tpu, tuple) else (tpu,)
    assert len(cpu) == len(tpu)
    for c, t in zip(cpu, tpu):
        assert t.device.type == "tpu" and t.dtype == c.dtype and t.shape == c.shape
        torch.testing.assert_close(t.cpu(), c)


OVERLAPS = {
    "add_shifted_out": lambda x: torch.add(x[:3], 1, out=x[1:]),
    "mul_shifted_out": lambda x: torch.mul(x[1:], 2, out=x[:3]),
    "add_disjoint_out": lambda x: torch.add(x[:2], 1, out=x[2:]),
    "add_same_out": lambda x: torch.add(x, 1, out=x),
    "neg_strided_out": lambda x: torch.neg(x[::2], out=x[1::2]),
    "add_inplace_shifted": lambda x: x[1:].add_(x[:3]),
    "add_inplace_self": lambda x: x.add_(x),
    "cumsum_shifted_out": lambda x: torch.cumsum(x[:3], 0, out=x[1:]),
    "sum_into_element": lambda x: torch.sum(x, 0, out=x[0]),
    "real_view_out": lambda x: torch.add(x[:3], 1, out=x.view(torch.int32)[1:].view(torch.float32)),
}


@pytest.mark.parametrize("case", sorted(OVERLAPS))
def test_overlapping_writes_match_cpu(case):
    results = []
    for dev in ("cpu", "tpu"):
        x = torch.arange(4.0, device=dev)
        try:
            OVERLAPS[case](x)
            results.append(x.cpu())
        except RuntimeError as error:
            results.append(error)
    cpu, tpu = results
    if isinstance(cpu, Exception):
        assert isinstance(tpu, RuntimeError), f"CPU raised {cpu!r}, tpu gave {tpu!r}"
        assert str(tpu).startswith(str(cpu))
        return
    assert not isinstance(tpu, Exception), repr(tpu)
    torch.testing.assert_close(tpu, cpu)


def _intermediate(write):
    def run(x):
        y = x * 2
        write(y)
        return y

    return run


# Overlap decided while tracing (the storage, offsets, sizes and strides of every tensor
# are known then): views of an argument and of a tensor made inside the function.
_TRACED_OVERLAPS = {
    # refused: partial overlap of an input and the written tensor
    "copy_shifted": lambda x: x[1:].copy_(x[:-1]),
    "setitem_shifted": lambda x: x.__setitem__(slice(1, None), x[:-1]),
    "copy_transposed": lambda x: x[:4].view(2, 2).t().copy_(x[:4].view(2, 2)),
    "add_out_shifted": lambda x: torch.add(x[:-1], 1, out=x[1:]),
    "mul_out_shifted": lambda x: torch.mul(x[1:], 2, out=x[:-1]),
    "add_inplace_shifted": lambda x: x[1:].add_(x[:-1]),
    "index_select_out_self": lambda x: torch.index_select(
        x, 0, torch.tensor([4, 3, 2, 1, 0], device=x.device), out=x
    ),
    "intermediate_copy_shifted": _intermediate(lambda y: y[1:].copy_(y[:-1])),
    "intermediate_add_out_shifted": _intermediate(lambda y: torch.add(y[:-1], 1, out=y[1:])),
    # refused: the written tensor's elements overlap each other
    "add_out_expanded": lambda x: torch.add(x, 1, out=x[:1].expand(5)),
    "add_inplace_expanded": lambda x: x[:1].expand(5).add_(1),
    "intermediate_add_out_expanded": _intermediate(lambda y: torch.add(y, 1, out=y[:1].expand(5))),
    # allowed: disjoint or identical memory
    "copy_disjoint": lambda x: x[1:3].copy_(x[3:5]),
    "copy_self": lambda x: x.copy_(x),
    "copy_strided": lambda x: x[::2][:2].copy_(x[1::2]),
    "add_out_fresh": lambda x: torch.add(x, 1, out=torch.empty(5, device=x.device)),
    "add_out_self": lambda x: torch.add(x, 1, out=x),
    "add_inplace_self": lambda x: x.add_(x),
    "intermediate_copy_disjoint": _intermediate(lambda y: y[:2].copy_(y[3:])),
}


def _call(fn, dev):
    try:
        return fn(torch.arange(5.0, device=dev))
    except RuntimeError as error:
        return error


def _fake_error_text(error) -> str:
    # Dynamo's text names the fake tensors of its device; the op's own error is the rest.
    return re.search(r"got (.*)\n", str(error)).group(1)


@pytest.mark.parametrize("mode", ["eager", "jit", "compile"])
@pytest.mark.parametrize("case", sorted(_TRACED_OVERLAPS))
def test_overlap_checks_hold_eager_and_compiled(case, mode):
    # Compiled modes check overlap while tracing, as eager does per op, with CPU's
    # exception and text. Compiled, the reference is CPU's torch.compile with the backend
    # that runs each op as eager (CPU's inductor computes a partial overlap silently);
    # an overlap Dynamo's fake tensors refuse raises its TorchRuntimeError on both devices.
    write = _TRACED_OVERLAPS[case]

    def fn(x):
        out = write(x)
        return out if isinstance(out, torch.Tensor) and out.shape == x.shape else x

    torch._dynamo.reset()
    try:
        if mode == "compile":
            cpu = _call(torch.compile(fn, backend="eager"), "cpu")
            before = torchjax.compile.dynamo_stats()["traces"]
            tpu = _call(torch.compile(fn, backend="tpu"), "tpu")
            traced = torchjax.compile.dynamo_stats()["traces"] - before
        else:
            cpu = _call(fn, "cpu")
            jitted = torchjax.jit(fn)
            tpu = _call(fn if mode == "eager" else jitted, "tpu")
            traced = jitted.trace_count
    finally:
        torch._dynamo.reset()
    if isinstance(cpu, torch._dynamo.exc.TorchDynamoException):
        assert type(tpu) is type(cpu), f"CPU raised {cpu!r}, tpu gave {tpu!r}"
        assert _fake_error_text(tpu) == _fake_error_text(cpu)
        return
    # The compiled modes ran a trace: the check fired there, not in an eager fallback.
    assert traced == (0 if mode == "eager" else 1)
    if isinstance(cpu, Exception):
        assert type(tpu) is type(cpu), f"CPU raised {cpu!r}, tpu gave {tpu!r}"
        assert str(tpu).startswith(str(cpu))
        return
    assert not isinstance(tpu, Exception), repr(tpu)
    torch.testing.assert_close(tpu.cpu(), cpu)


def test_nonzero_out_dtype_error_has_torchs_text():
    # torch's own nonzero check; the generic out= text did not match what torch raises.
    text = "nonzero: Expected out tensor to have scalar type Long but got scalar typeFloat"
    for device in ("cpu", "tpu"):
        x = torch.randn(3, 3, device=device)
        with pytest.raises(RuntimeError, match=text):
            torch.nonzero(x, out=torch.empty([], device=device))


_KERNEL_OUT_DTYPES = {
    "amax_wider": lambda d: torch.amax(
        torch.ones(3, device=d), 0, out=torch.empty((), dtype=torch.float64, device=d)
    ),
    "amin_narrower": lambda d: torch.amin(
        torch.ones(3, dtype=torch.int64, device=d),
        0,
        out=torch.empty((), dtype=torch.int32, device=d),
    ),
    "any_float": lambda d: torch.any(
        torch.ones(3, device=d), 0, out=torch.empty((), dtype=torch.float32, device=d)
    ),
    "all_long": lambda d: torch.all(
        torch.ones(3, device=d), 0, out=torch.empty((), dtype=torch.int64, device=d)
    ),
    "index_copy_double_source": lambda d: torch.zeros(3, device=d).index_copy_(
        0, torch.tensor([1], device=d), torch.ones(1, dtype=torch.float64, device=d)
    ),
}


@pytest.mark.parametrize("name", sorted(_KERNEL_OUT_DTYPES))
def test_kernel_dtype_checks_refuse_as_cpu(name):
    # Checks CPU's kernels make (meta functions do not): the same exception and text.
    call = _KERNEL_OUT_DTYPES[name]
    with pytest.raises(RuntimeError) as want:
        call("cpu")
    with pytest.raises(RuntimeError) as got:
        call("tpu")
    assert str(want.value).split(" (in aten")[0] in str(got.value)


def test_all_into_uint8_computes_as_cpu():
    x = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    want = torch.empty(2, dtype=torch.uint8)
    torch.all(x, 1, out=want)
    got = torch.empty(2, dtype=torch.uint8, device="tpu")
    torch.all(x.to("tpu"), 1, out=got)
    assert torch.equal(got.cpu(), want)


_MULTI_OUT = {
    "sort": lambda d, o: torch.sort(torch.randn(3, 4).to(d), 1, out=o),
    "topk": lambda d, o: torch.topk(torch.randn(3, 4).to(d), 2, out=o),
    "max_dim": lambda d, o: torch.max(torch.randn(3, 4).to(d), 1, out=o),
    "aminmax": lambda d, o: torch.aminmax(torch.randn(3, 4).to(d), dim=1, out=o),
    "cummax": lambda d, o: torch.cummax(torch.randn(3, 4).to(d), 1, out=o),
}


@pytest.mark.parametrize("name", sorted(_MULTI_OUT))
def test_multi_output_values_of_another_dtype_refuse_as_cpu(name):
    # Every output of a multi-output op must have its result's dtype, values included.
    def outs(d):
        second = torch.float64 if name == "aminmax" else torch.long
        return (
            torch.empty(0, dtype=torch.float64, device=d),
            torch.empty(0, dtype=second, device=d),
        )

    with pytest.raises(RuntimeError):
        _MULTI_OUT[name]("cpu", outs("cpu"))
    with pytest.raises(RuntimeError, match="dtype|type"):
        _MULTI_OUT[name]("tpu", outs("tpu"))


def test_index_add_of_another_dtype_refuses_as_cpu():
    for d in ("cpu", "tpu"):
        self = torch.zeros(3, device=d)
        with pytest.raises(RuntimeError, match="must have the same scalar type"):
            self.index_add(
                0, torch.tensor([0], device=d), torch.ones(1, dtype=torch.float64, device=d)
            )
        with pytest.raises(RuntimeError, match="must have the same scalar type"):
            self.index_add_(
                0, torch.tensor([0], device=d), torch.ones(1, dtype=torch.int64, device=d)
            )


@pytest.mark.parametrize("op", [torch.isposinf, torch.isneginf], ids=lambda f: f.__name__)
def test_isposinf_isneginf_refuse_non_boolean_outputs_as_cpu(op):
    x = torch.tensor([1.0, float("inf"), -float("inf")])
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="does not support non-boolean outputs"):
            op(x.to(device), out=torch.empty(3).to(device))
    out = torch.empty(3, dtype=torch.bool).to("tpu")
    assert op(x.to("tpu"), out=out).tolist() == op(x).tolist()


@pytest.mark.parametrize(
    "out_dtype",
    [torch.complex64, torch.complex128, torch.float32, torch.float64, torch.float16, torch.int64],
)
def test_abs_of_complex_into_out_as_cpu(out_dtype):
    # CPU's kernel writes a complex out of self's dtype (imaginary part zero) and casts
    # into real outs; the meta function refuses every dtype but float32.
    z = torch.tensor([3 + 4j, -1j, -2 + 0j])
    results = {}
    for device in ("cpu", "tpu"):
        out = torch.full((3,), 7, dtype=out_dtype, device=device)
        try:
            got = torch.abs(z.to(device), out=out)
            assert got is out
            results[device] = (out.dtype, out.cpu().tolist())
        except RuntimeError as error:
            results[device] = (RuntimeError, str(error).split(" (in aten::")[0])
    assert results["tpu"] == results["cpu"]


@pytest.mark.parametrize(
    "values", [[[0, 1], [1, 1]], [[0.0, 0, 0]], [[[1, 1], [1, 1]], [[1, 0], [1, 1]]], 3]
)
@pytest.mark.parametrize("out_shape", [(0,), (3, 2), (2, 2)], ids=["empty", "3x2", "2x2"])
def test_nonzero_out_takes_cpus_strides(values, out_shape):
    # nonzero's CPU kernel lays an out= it resizes in Fortran order (strides (1, n)); one
    # that already has the result's shape keeps its strides.
    results = {}
    for device in ("cpu", "tpu"):
        out = torch.zeros(out_shape, dtype=torch.long, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the resize warning
            torch.nonzero(torch.tensor(values, device=device), out=out)
        results[device] = out
    cpu, tpu = results["cpu"], results["tpu"]
    assert (tpu.shape, tpu.stride()) == (cpu.shape, cpu.stride())
    assert torch.equal(tpu.cpu(), cpu)
