"""Indexing ops (torchjax/ops/indexing.py): OpInfo sweep plus aliasing and errors."""

import pytest
import torch

from tests.ops.opinfo_cases import make_tests
from tests.ops.test_view_ops import both

OPS = [
    "index_put",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_reduce.sum",
    "scatter_reduce.prod",
    "scatter_reduce.mean",
    "scatter_reduce.amax",
    "scatter_reduce.amin",
    "index_select",
    "index_add",
    "index_copy",
    "index_fill",
    "masked_fill",
    "masked_scatter",
    "masked_select",
    "nonzero",
    "take",
    "take_along_dim",
    "where",
]
globals().update(make_tests(OPS))


def _mask(x, k=5):
    return (torch.arange(24.0).reshape(2, 3, 4) > k).to(x.device)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x[torch.tensor([0, 1, 1])],
        lambda x: x[:, torch.tensor([True, False, True])],
        lambda x: x[_mask(x)],
        lambda x: x[None, torch.tensor([1]), ..., torch.tensor([0, 3])],
        lambda x: x[torch.tensor([[0], [1]]), :, torch.tensor([1, 2])],
        lambda x: x[:, torch.tensor([-1, 0], dtype=torch.int32)],
        lambda x: x[torch.tensor([], dtype=torch.int64)],
    ],
    ids=["int", "bool_dim", "full_mask", "none_ellipsis", "nonadjacent", "neg_int32", "empty"],
)
def test_getitem(fn):
    both(fn)


def test_getitem_cpu_index_on_tpu_tensor():
    x = torch.arange(10.0)
    idx = torch.tensor([3, 1, 4])
    torch.testing.assert_close(x.to("tpu")[idx].cpu(), x[idx])


def test_setitem_and_index_put_aliasing():
    def fn(x):
        v = x[1]  # a live view: must see the index_put_ on the base
        x[torch.tensor([1, 0]), 1] = torch.tensor(7.0).to(x.device)
        x[_mask(x, 20)] = -1.0
        return v.clone()

    both(fn)


def test_index_put_on_view_reaches_base():
    def fn(x):
        x.transpose(0, 2)[torch.tensor([1, 3])] = 0.0
        x[0].index_put_(
            (torch.tensor([2, 2]).to(x.device),), torch.ones(4, device=x.device), accumulate=True
        )
        return x

    both(fn)


def test_kv_cache_tensor_position():
    def fn(cache):
        pos = torch.tensor([2, 4]).to(cache.device)
        k = torch.arange(2 * 3 * 2 * 5.0).reshape(2, 3, 2, 5).to(cache.device)
        cache[:, :, pos] = k
        return cache

    both(fn, lambda: torch.zeros(2, 3, 6, 5))


def test_inplace_index_ops_on_views():
    def fn(x):
        idx = torch.tensor([0, 2]).to(x.device)
        x[1].index_fill_(1, idx, -3.0)
        x[:, 0].index_add_(1, idx, torch.ones(2, 2, device=x.device))
        x.t() if x.dim() == 2 else x[0].t().masked_fill_(_mask(x)[0].t(), 0.5)
        x[1].scatter_(1, torch.tensor([[1], [0], [3]]).to(x.device), 9.0)
        return x

    both(fn)


def test_int64_past_2_31():
    big = lambda: torch.tensor([2**40, -(2**33), 5, 2**62])  # noqa: E731
    both(lambda x: x[torch.tensor([3, 0])], big)
    both(lambda x: x.gather(0, torch.tensor([1, 1]).to(x.device)), big)
    both(lambda x: x.index_put_((torch.tensor([2]),), torch.tensor(2**50)), big)


def test_nonzero_and_masked_select_zero_d_and_empty():
    # torch's CPU nonzero of an empty input has odd strides; values/shape are what count.
    both(lambda x: x.nonzero(), lambda: torch.tensor(3.0), strides=False)
    both(lambda x: x.nonzero(), lambda: torch.zeros(0, 3), strides=False)
    both(lambda x: x.masked_select(torch.tensor(True).to(x.device)))


@pytest.mark.parametrize("immediate", [False, True])
def test_out_of_range_raises_index_error(immediate):
    # Default: checked on the device, raised at the next sync; immediate mode: at the op.
    x = torch.zeros(3, 4, device="tpu")
    # CPU's exception types: IndexError, but RuntimeError for gather.
    cases = [
        (
            IndexError,
            "index 3 is out of bounds for dimension 0 with size 3 .in aten::index.Tensor",
            lambda: x[torch.tensor([3])],
        ),
        (
            IndexError,
            "index -4 is out of bounds.*aten::index_put",
            lambda: x.__setitem__(torch.tensor([-4]), 1.0),
        ),
        (
            RuntimeError,
            "index 4 is out of bounds for dimension 1.*aten::gather",
            lambda: x.gather(1, torch.tensor([[4]]).to("tpu")),
        ),
        (
            IndexError,
            "index 5 .*aten::index_select",
            lambda: x.index_select(0, torch.tensor([5]).to("tpu")),
        ),
        (IndexError, "index 12 .*aten::take", lambda: x.take(torch.tensor([12]).to("tpu"))),
    ]
    torch.tpu.set_sync_checks(immediate)
    try:
        for exc, match, fn in cases:
            if immediate:
                with pytest.raises(exc, match=match):
                    fn()
            else:
                fn()
                with pytest.raises(exc, match=match):
                    torch.tpu.synchronize()
    finally:
        torch.tpu.set_sync_checks(False)


def test_index_put_dtype_mismatch_raises():
    x = torch.zeros(3, device="tpu")
    with pytest.raises(RuntimeError, match="Index put requires"):
        x.index_put_((torch.tensor([0]),), torch.tensor([1], dtype=torch.int64).to("tpu"))


def test_bool_scatter_reduce_mean_is_refused_as_on_cpu():
    # It returned an int32 tensor (floor division promoted the bool).
    def run(dev):
        t = torch.tensor([True, False], device=dev)
        index = torch.tensor([0, 0], device=dev)
        return t.scatter_reduce(0, index, torch.tensor([True, True], device=dev), "mean")

    with pytest.raises(NotImplementedError):
        run("cpu")
    with pytest.raises(NotImplementedError, match="scatter_reduce"):
        run("tpu")


def _signs(dev, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, 5, generator=g).to(dtype).to(dev)


def _v(x, t):
    return t.to(x.device, x.dtype)


_MASKED_PUTS = {
    "scalar": lambda x: x.__setitem__(x < 0, 0.0),
    "row of values": lambda x: x.__setitem__(x[:, :, 0] > 0, _v(x, torch.arange(5.0))),
    "leading ones": lambda x: x.__setitem__(x[:, :, 0] > 0, _v(x, torch.full((1, 1, 5), -2.0))),
    "after a slice": lambda x: x.__setitem__((slice(None), x[0, :, 0] > 0), 7.0),
    "2-d mask after a slice": lambda x: x.__setitem__((slice(None), x[0] > 0), -1.0),
    "accumulate": lambda x: x.index_put_((x > 0,), _v(x, torch.tensor(0.5)), accumulate=True),
    "accumulate a row": lambda x: x.index_put_(
        (x[..., 0] > 0,), _v(x, torch.ones(5)), accumulate=True
    ),
    "empty mask": lambda x: x.__setitem__(x > 1e9, 3.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_MASKED_PUTS))
def test_masked_put_of_shared_values_matches_cpu_eager_and_jitted(name, dtype):
    # Every selected element gets the same values: a fixed-shape where, so it also runs
    # under torchjax.jit and reads nothing back to the host.
    import jax

    import torchjax

    def run(x):
        _MASKED_PUTS[name](x)
        return x

    want = run(_signs("cpu", dtype))
    run(_signs("tpu", dtype))  # compiles
    x = _signs("tpu", dtype)
    with jax.transfer_guard_device_to_host("disallow"):
        got = run(x)
    jitted = torchjax.jit(run)(_signs("tpu", dtype))
    for out in (got, jitted):
        assert out.dtype == want.dtype
        torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


def test_masked_put_of_one_value_per_element_stays_eager_only():
    # Values with one entry per selected element need the count: eager only.
    import torchjax
    from torchjax.tensor._errors import DataDependentError

    def run(x):
        x[x > 0] = torch.arange(float((x > 0).sum()), device=x.device)
        return x

    want = run(_signs("cpu"))
    torch.testing.assert_close(run(_signs("tpu")).cpu(), want)

    def traced(x, v):
        x[x > 0] = v
        return x

    n = int((_signs("cpu") > 0).sum())
    with pytest.raises(DataDependentError, match="index_put_"):
        torchjax.jit(traced)(_signs("tpu"), torch.arange(float(n), device="tpu"))


@pytest.mark.parametrize("mask_shape", [(3, 5), (3, 4, 5, 1)])
def test_masked_put_with_a_mask_of_the_wrong_shape_refuses_as_cpu(mask_shape):
    errors = {}
    for dev in ("cpu", "tpu"):
        x = _signs(dev)
        with pytest.raises(IndexError) as info:
            x[torch.ones(mask_shape, dtype=torch.bool, device=dev)] = 1.0
        errors[dev] = str(info.value)
    assert errors["tpu"].startswith(errors["cpu"].split(" (")[0][:40]), errors


_UNBROADCASTABLE = {
    "int and int": lambda x, d: x[torch.tensor([0, 1, 2], device=d), torch.tensor([0, 1]).to(d)],
    "mask and int": lambda x, d: x[torch.tensor([False, True, True, True], device=d), [2, 3]],
    "set": lambda x, d: x.__setitem__((torch.tensor([0, 1, 2], device=d), [1, 2]), -1.0),
    "set mask and int": lambda x, d: x.__setitem__(
        (torch.tensor([False, True, True, True], device=d), [2, 3]), -1.0
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_UNBROADCASTABLE))
def test_index_tensors_that_do_not_broadcast_refuse_as_cpu(name):
    messages = {}
    for dev in ("cpu", "tpu"):
        x = torch.arange(20.0, device=dev).reshape(4, 5)
        with pytest.raises(IndexError) as info:
            _UNBROADCASTABLE[name](x, dev)
        messages[dev] = str(info.value)
    assert messages["cpu"].startswith("shape mismatch: indexing tensors could not be broadcast")
    assert messages["tpu"].startswith(messages["cpu"]), messages


@pytest.mark.parametrize(
    "shape, nonzero_at",
    [((2, 3), [0, 2, 4, 5]), ((3,), []), ((3,), [0, 1, 2]), ((), [0]), ((), []), ((2, 0), [])],
)
def test_nonzero_results_have_cpus_strides(shape, nonzero_at):
    # CPU lays nonzero's (n, ndim) result out dimension by dimension: strides (1, n).
    def results(dev):
        x = torch.zeros(shape).reshape(-1)
        x[nonzero_at] = 1.0
        x = x.reshape(shape).to(dev)
        outs = [torch.nonzero(x), torch.argwhere(x), *torch.nonzero(x, as_tuple=True)]
        outs += list(torch.where(x > 0))
        return [(o.cpu(), o.stride()) for o in outs]

    want, got = results("cpu"), results("tpu")
    assert len(got) == len(want) >= 3
    for (g, gs), (w, ws) in zip(got, want):
        assert gs == ws
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "index, value_shape",
    [("mask", (3,)), ("mask", (3, 5)), ("ints", (3, 5)), ("ints", (2, 4))],
)
def test_index_put_of_values_that_do_not_broadcast_refuses_as_cpu(index, value_shape):
    messages = {}
    for dev in ("cpu", "tpu"):
        x = torch.zeros(4, 5, device=dev)
        idx = (
            torch.tensor([True, False, True, False], device=dev)
            if index == "mask"
            else torch.tensor([0, 1], device=dev)
        )
        with pytest.raises(RuntimeError) as info:
            x[idx] = torch.ones(value_shape, device=dev)
        messages[dev] = str(info.value)
    assert messages["cpu"].startswith("shape mismatch: value tensor of shape")
    assert messages["tpu"].startswith(messages["cpu"]), messages


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(0),
        torch.tensor(0.5, dtype=torch.float64),
        torch.tensor([1]),
        torch.tensor(True),
    ],
    ids=["int", "float64", "one-element int", "bool"],
)
def test_masked_put_of_a_cpu_one_element_value_casts_as_cpu(value):
    # ATen turns it into masked_fill_ with a number (canDispatchToMaskedFill).
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    t = x.to("tpu")
    x[x > 0] = value
    t[t > 0] = value
    x[:, x[0] < 0] = value
    t[:, t[0] < 0] = value
    assert t.dtype == x.dtype
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)


def test_masked_put_of_a_device_value_of_another_dtype_refuses_as_cuda():
    # A value on the device takes index_put_'s dtype check, as a CUDA value does.
    t = torch.randn(4, 5).to("tpu")
    with pytest.raises(RuntimeError, match="got Float for the destination and Long for the source"):
        t[t > 0] = torch.tensor(1).to("tpu")


@pytest.mark.parametrize(
    "before, after", [(0, 2), (1, 1), (2, 0)], ids=["mask-first", "mask-middle", "mask-last"]
)
def test_index_put_of_a_cpu_scalar_places_the_mask_at_its_dims(before, after):
    # masked_fill_ form of index_put_ (a one-element CPU value): the mask was broadcast
    # from the right, so [None, mask, None] on (1, 2, 2, 1) asked for (1, 2, 2, 2).
    shape = [1] * before + [2, 2] + [1] * after
    mask = torch.tensor([[True, False], [False, True]])
    indices = [None] * before + [mask] + [None] * after
    want = torch.ops.aten.index_put_(torch.zeros(shape), indices, torch.tensor(5.0))
    tpu_indices = [None] * before + [mask.to("tpu")] + [None] * after
    got = torch.ops.aten.index_put_(torch.zeros(shape, device="tpu"), tpu_indices, torch.tensor(5))
    assert got.shape == want.shape and torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "call, text",
    [
        (
            lambda t: t(torch.empty(10, 0))[:, [0, 1]],
            "index is out of bounds for dimension with size 0",
        ),
        (
            lambda t: torch.ops.aten.index.Tensor(t(torch.arange(3.0)), []),
            "at least one index must be provided",
        ),
    ],
    ids=["size-0-dim", "no-index"],
)
def test_index_refusals_known_from_shapes_match_cpu(call, text):
    with pytest.raises(IndexError, match=text):
        call(lambda x: x)
    with pytest.raises(IndexError, match=text):
        call(lambda x: x.to("tpu"))
    empty = torch.empty(10, 0)
    assert empty.to("tpu")[:, torch.tensor([], dtype=torch.long)].shape == (10, 0)


def test_index_fill_of_a_complex_scalar_on_a_real_tensor_has_cpus_text():
    text = "index_fill_\\(\\): Converting complex Scalar to non-complex type is not supported"
    for device in ("cpu", "tpu"):
        for value in (1 + 2j, torch.tensor(1 + 2j)):
            with pytest.raises(RuntimeError, match=text):
                x = torch.zeros(3, device=device)
                x.index_fill_(0, torch.tensor([0], device=device), value)


def test_uint8_indices_warn_as_deprecated_as_on_cpu():
    import warnings

    mask = torch.tensor([1, 0, 1], dtype=torch.uint8)
    by_device = {}
    for device in ("cpu", "tpu"):
        x = torch.arange(3.0, device=device)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = x[mask.to(device)]
            x[mask.to(device)] = torch.tensor([5.0, 6.0], device=device)
        texts = [str(w.message) for w in seen if "torch.uint8 is now deprecated" in str(w.message)]
        assert len(texts) == 2, (device, texts)  # one per indexing call, as ATen's
        assert got.tolist() == [0.0, 2.0] and x.tolist() == [5.0, 1.0, 6.0]
        by_device[device] = texts
    # The same text, trailing space included (CPU's may end with where it was raised).
    assert by_device["tpu"] == [t.split("(Triggered internally")[0] for t in by_device["cpu"]]
    # Two uint8 masks in one index: one warning each, as ATen's expandTensors.
    v = torch.randn(5, 7, 3)
    masks = (torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8), torch.ones(3, dtype=torch.uint8))
    counts = []
    for device in ("cpu", "tpu"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            shape = v.to(device)[masks[0].to(device), :, masks[1].to(device)].shape
        assert shape == (3, 7)
        counts.append(sum("torch.uint8 is now deprecated" in str(w.message) for w in seen))
    assert counts == [2, 2]
    with pytest.raises(RuntimeError, match="masked_fill_ only supports boolean masks"):
        torch.ops.aten.index_put_(torch.arange(3.0).to("tpu"), [mask.to("tpu")], torch.tensor(0.0))


@pytest.mark.parametrize(
    "value, part",
    [([], 4), ([1, 2, 3], 4), ([1, 2, 3], 1), ([1.0, 2.0], 4), ([1.0, 2.0, 3.0, 4.0], 4)],
    ids=["empty_float", "three_ints", "three_into_one", "two_floats", "four_floats"],
)
def test_index_put_checks_the_shape_before_the_dtype_as_cpu(value, part):
    # A float value into an int tensor at a mask: CPU names the shape mismatch first
    # (PyTorch's test_boolean_assignment_value_mismatch), the dtype only if it fits.
    def put(device):
        a = torch.arange(0, 4, device=device)[:part]
        a[a > -1] = torch.tensor(value).to(device)

    with pytest.raises(RuntimeError) as cpu:
        put("cpu")
    with pytest.raises(RuntimeError) as got:
        put("tpu")
    assert str(cpu.value).split(" (Triggered")[0] in str(got.value)


_L = torch.long
# index larger than self (or src) off dim: CPU refuses; jax's gather clamps and its
# scatter drops, so these returned values on tpu (gather: the last row repeated).
_SHAPE_CASES = {
    "gather": lambda a, d: a.gather(1, torch.zeros(5, 2, dtype=_L, device=d)),
    "gather_dim_larger_ok": lambda a, d: a.gather(1, torch.zeros(2, 7, dtype=_L, device=d)),
    "gather_0d_self": lambda a, d: a[0, 0].gather(0, torch.zeros(1, dtype=_L, device=d)),
    "scatter_value": lambda a, d: a.scatter(1, torch.zeros(5, 2, dtype=_L, device=d), 1.0),
    "scatter_value_": lambda a, d: a.clone().scatter_(
        1, torch.zeros(5, 2, dtype=_L, device=d), 2.0
    ),
    "scatter_src": lambda a, d: a.scatter(
        1, torch.zeros(5, 2, dtype=_L, device=d), torch.ones(5, 2, device=d)
    ),
    "scatter_src_smaller": lambda a, d: a.scatter(
        1, torch.zeros(2, 2, dtype=_L, device=d), torch.ones(1, 2, device=d)
    ),
    "scatter_dim_larger_ok": lambda a, d: a.scatter(
        1, torch.zeros(2, 7, dtype=_L, device=d), torch.ones(2, 7, device=d)
    ),
    "scatter_src_fewer_dims": lambda a, d: a.scatter(
        1, torch.zeros(2, 2, dtype=_L, device=d), torch.ones(2, device=d)
    ),
    "scatter_src_fewer_dims_and_smaller": lambda a, d: a.scatter(
        1, torch.zeros(3, 2, dtype=_L, device=d), torch.ones(2, device=d)
    ),
    "scatter_reduce_arg": lambda a, d: a.scatter(
        1, torch.zeros(5, 2, dtype=_L, device=d), torch.ones(5, 2, device=d), reduce="add"
    ),
    "scatter_add": lambda a, d: a.scatter_add(
        1, torch.zeros(2, 2, dtype=_L, device=d), torch.ones(2, 1, device=d)
    ),
    "scatter_reduce": lambda a, d: a.scatter_reduce(
        1, torch.zeros(5, 2, dtype=_L, device=d), torch.ones(5, 2, device=d), "sum"
    ),
    "scatter_reduce_exclude_self": lambda a, d: a.scatter_reduce(
        -1, torch.zeros(5, 2, dtype=_L, device=d), torch.ones(5, 2, device=d), "amax", False
    ),
    "gather_out": lambda a, d: torch.gather(
        a, 1, torch.zeros(5, 2, dtype=_L, device=d), out=torch.empty(5, 2, device=d)
    ),
}


def _t(d, *x, **k):
    return torch.tensor(*x, device=d, **k)


# CPU's checks of put / index_copy / masked_scatter, in its order; several ran on tpu
# (an int32 index, a source of another dtype, a scalar source with two indices).
_ARGUMENT_CASES = {
    "put_dtype_then_numel": lambda a, d: a.put(
        _t(d, [0, 1]), torch.ones(3, dtype=torch.float64, device=d)
    ),
    "put_int32_index": lambda a, d: a.put(
        _t(d, [0, 1], dtype=torch.int32), torch.ones(2, device=d)
    ),
    "put_numel": lambda a, d: a.put(_t(d, [0, 1]), torch.ones(3, device=d)),
    "put_into_empty": lambda a, d: a[:0].put(_t(d, [0]), torch.ones(1, device=d)),
    "put_2d_source": lambda a, d: a.put(_t(d, [[0, 1]]), torch.ones(2, 1, device=d)),
    "put_bf16_f32_source": lambda a, d: a.bfloat16().put_(_t(d, [0]), _t(d, [9.0])),
    "index_copy_2d_index": lambda a, d: a.index_copy(
        0, _t(d, [[0, 1]]), torch.ones(2, 4, device=d)
    ),
    "index_copy_scalar_source": lambda a, d: a.index_copy(0, _t(d, [0, 1]), _t(d, 1.0)),
    "index_copy_dims": lambda a, d: a.index_copy(0, _t(d, [0, 1]), torch.ones(2, 4, 1, device=d)),
    "index_copy_int32": lambda a, d: a.index_copy(
        0, _t(d, [0, 1], dtype=torch.int32), torch.ones(2, 4, device=d)
    ),
    "index_copy_slices": lambda a, d: a.index_copy(0, _t(d, [0, 1]), torch.ones(2, 3, device=d)),
    "index_copy_slices_3d": lambda a, d: a.reshape(1, 3, 4).index_copy(
        1, _t(d, [0, 1]), torch.ones(1, 2, 3, device=d)
    ),
    "index_copy_count": lambda a, d: a.index_copy(0, _t(d, [0, 1]), torch.ones(3, 4, device=d)),
    "index_copy_ok": lambda a, d: a.index_copy(1, _t(d, [0, 1]), torch.ones(3, 2, device=d)),
    "masked_scatter_dtype_first": lambda a, d: a.masked_scatter(
        (a > 2).int(), torch.ones(6, dtype=torch.float64, device=d)
    ),
    "masked_scatter_int_mask": lambda a, d: a.masked_scatter(
        (a > 2).int(), torch.ones(9, device=d)
    ),
    "masked_scatter_ok": lambda a, d: a.masked_scatter(a > 2, torch.ones(9, device=d)),
}
_CASES = {**_SHAPE_CASES, **_ARGUMENT_CASES}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_gather_scatter_put_index_copy_arguments_checked_as_cpu(case):
    from torchjax.testing.opinfo import same_or_refused

    call = _CASES[case]
    a = torch.arange(12.0).reshape(3, 4)
    error = same_or_refused(lambda d: call(a.to(d), d), case)
    if error is None:
        return
    try:
        call(a.to("tpu"), "tpu")
    except Exception as got:  # noqa: BLE001 - CPU's text, then the op's name
        assert str(got).startswith(str(error).splitlines()[0]), (got, error)


_F32_INDEX = {"float": torch.float32, "int32": torch.int32}
# Per op, CPU's exception and text for an index dtype it refuses (index_fill takes int64
# only: an int32 index ran on tpu), and a 2-d index.
_INDEX_DTYPE_CASES = {
    f"{op}_{name}": (op, dt)
    for op in ("gather", "scatter", "scatter_add", "index_select", "index_add", "index_fill")
    for name, dt in _F32_INDEX.items()
} | {f"{op}_int16": (op, torch.int16) for op in ("index_select", "index_add", "index_fill")}


def _index_call(op, a, index):
    d = a.device
    if op == "gather":
        return a.gather(1, index.reshape(3, 1))
    if op == "scatter":
        return a.scatter(1, index.reshape(3, 1), 1.0)
    if op == "scatter_add":
        return a.scatter_add(1, index.reshape(3, 1), torch.ones(3, 1, device=d))
    if op == "index_select":
        return a.index_select(0, index)
    if op == "index_add":
        return a.index_add(0, index, torch.ones(3, 4, device=d))
    return a.index_fill(0, index, 1.0)


@pytest.mark.parametrize("case", sorted(_INDEX_DTYPE_CASES))
def test_index_dtypes_refused_with_cpus_type_and_text(case):
    from torchjax.testing.opinfo import same_or_refused

    op, dt = _INDEX_DTYPE_CASES[case]
    a = torch.arange(12.0).reshape(3, 4)
    index = torch.zeros(3, dtype=dt)
    error = same_or_refused(lambda d: _index_call(op, a.to(d), index.to(d)), case)
    if error is not None:
        with pytest.raises(type(error)) as got:
            _index_call(op, a.to("tpu"), index.to("tpu"))
        assert str(got.value).startswith(str(error)), (got.value, error)


@pytest.mark.parametrize("op", ["index_select", "index_add", "index_fill"])
def test_two_dim_index_refused_with_cpus_type_and_text(op):
    a, index = torch.arange(12.0).reshape(3, 4), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(Exception) as cpu:
        _index_call(op, a, index)
    with pytest.raises(type(cpu.value)) as got:
        _index_call(op, a.to("tpu"), index.to("tpu"))
    assert str(got.value).startswith(str(cpu.value)), (got.value, cpu.value)


def test_masked_fill_broadcast_refusal_names_the_mask_first_as_cpu():
    # CPU expands the mask against self (tensor a is the mask); the text had them swapped.
    a, mask = torch.arange(12.0).reshape(3, 4), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError) as cpu:
        a.masked_fill(mask, 1.0)
    with pytest.raises(RuntimeError) as got:
        a.to("tpu").masked_fill(mask.to("tpu"), 1.0)
    assert str(got.value).startswith(str(cpu.value)), (got.value, cpu.value)


def test_in_place_masked_fill_broadcast_refusal_names_self_first_as_cpu():
    # The in-place form checks self against the mask, in the schema's order.
    a, mask = torch.arange(12.0).reshape(3, 4), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError) as cpu:
        a.clone().masked_fill_(mask, 1.0)
    with pytest.raises(RuntimeError) as got:
        a.to("tpu").masked_fill_(mask.to("tpu"), 1.0)
    assert str(got.value).startswith(str(cpu.value)), (got.value, cpu.value)


def test_eager_nonzero_compiles_no_program():
    # Note [nonzero on the host]: the count is read anyway; the coordinates are CPU's.
    # Lowered op by op it compiled ~15 programs, and again for each new count. A shape
    # no other test uses, so jax's own caches hold nothing for it.
    import torchjax

    def programs():
        s = torchjax.stats()
        return s["compiles"] + s["persistent_cache_hits"]

    made = [torch.zeros(5, 41).index_fill_(1, torch.tensor(cols), 2.5) for cols in ([3], [0, 7])]
    on_tpu = [x.to("tpu") * 1.0 for x in made]  # values made on the device: read back
    torch.tpu.synchronize()  # made now, also in fused eager mode
    before = programs()
    got = [torch.nonzero(x) for x in on_tpu]
    assert programs() == before
    for g, x in zip(got, made):
        want = torch.nonzero(x)
        assert g.device.type == "tpu" and g.stride() == want.stride()
        torch.testing.assert_close(g.cpu(), want)
        assert len(want) > 0


def test_nonzero_of_a_large_input_stays_on_the_device(monkeypatch):
    # Note [nonzero on the host]: past HOST_NONZERO_MAX elements the device path runs
    # (one count read, not the whole mask); CPU's coordinates and strides either way.
    from torchjax.ops import masking

    calls, device_path = [], masking._coordinates
    monkeypatch.setattr(masking, "HOST_NONZERO_MAX", 10)
    monkeypatch.setattr(masking, "_coordinates", lambda *a: calls.append(1) or device_path(*a))
    x = torch.zeros(3, 7).index_fill_(1, torch.tensor([2, 5]), 1.0)
    got, want = torch.nonzero(x.to("tpu")), torch.nonzero(x)
    assert calls == [1]
    assert got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want)
