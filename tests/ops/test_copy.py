"""Metadata handlers of torchjax/ops/copy.py, and the torch.func transforms that need them.

Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) asks
``aten::_has_same_storage_numel`` in ``make_dual``; reverse-mode transforms (vmap, grad,
jacrev, hessian) are checked beside them so every transform stays compared with CPU.
"""

import pytest
import torch
from torch import func

import torchjax

TOL = dict(rtol=1e-5, atol=1e-5)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.LayerNorm(5))


def _on(dev, *ts):
    return tuple(t.to(dev) for t in ts)


def test_has_same_storage_numel_matches_cpu():
    cases = [
        lambda d: (torch.arange(12.0, device=d), torch.ones(12, device=d)),
        lambda d: (torch.arange(12.0, device=d)[:6], torch.ones(12, device=d)),
        lambda d: (torch.arange(12.0, device=d)[:6], torch.ones(6, device=d)),
        lambda d: (torch.arange(12.0, device=d).view(3, 4), torch.ones(12, device=d)),
        lambda d: (torch.ones(12, device=d).view(torch.int16), torch.ones(24, device=d)),
        lambda d: (torch.ones(6, dtype=torch.float64, device=d), torch.ones(12, device=d)),
    ]
    for i, make in enumerate(cases):
        want = torch.ops.aten._has_same_storage_numel(*make("cpu"))
        assert torch.ops.aten._has_same_storage_numel(*make("tpu")) == want, i


def _set_to_cases(d):
    x = torch.arange(24.0, device=d).view(4, 6)
    y = x.clone()
    other = torch.empty(0, device=d).set_(x.untyped_storage(), 6, (3, 6), (6, 1))
    return [
        (x, x),
        (x, x.view(4, 6)),  # a view with the same geometry
        (x, x.view(24)),
        (x, x.t()),
        (x[1:], x[1:]),  # an offset
        (x[1:], other),  # the same geometry through set_ of the storage
        (x[0], x[1]),
        (x[:, 1:3], x[:, 1:3]),
        (x, y),  # another root with the same values
        (x.view(torch.int32), x),  # dtypes are not compared
        (torch.empty(0, device=d), torch.empty(0, device=d)),
    ]


def test_is_set_to_matches_cpu():
    cases = list(zip(_set_to_cases("cpu"), _set_to_cases("tpu")))
    assert len(cases) == 11
    for i, ((ca, cb), (ta, tb)) in enumerate(cases):
        assert ta.is_set_to(tb) is ca.is_set_to(cb), i
    assert [a.is_set_to(b) for a, b in _set_to_cases("cpu")].count(True) == 6
    x = torch.ones(3, device="tpu")
    assert not x.is_set_to(x.cpu())


def test_is_pinned_is_false_as_for_a_cuda_tensor():
    x = torch.ones(3, device="tpu")
    assert x.is_pinned() is False and x[1:].is_pinned() is False
    with pytest.warns(DeprecationWarning, match=r"argument 'device' of Tensor.is_pinned\(\) is"):
        assert x.is_pinned(torch.device("tpu")) is False


def test_forward_ad_make_dual_matches_cpu():
    import torch.autograd.forward_ad as fwAD

    x, v = torch.randn(3, 4), torch.randn(3, 4)
    out = {}
    for dev in ("cpu", "tpu"):
        xd, vd = _on(dev, x, v)
        with fwAD.dual_level():
            dual = fwAD.make_dual(xd, vd)
            y = (dual.sin() * dual).sum(1)
            primal, tangent = fwAD.unpack_dual(y)
            out[dev] = (primal.cpu(), tangent.cpu())
    torch.testing.assert_close(out["tpu"], out["cpu"], **TOL)


def test_jvp_of_a_module_matches_cpu():
    m = _model()
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    want = func.jvp(m, (x,), (v,))
    mt = _model().to("tpu")
    got = func.jvp(mt, _on("tpu", x), _on("tpu", v))
    torch.testing.assert_close(tuple(t.cpu() for t in got), want, **TOL)


@pytest.mark.parametrize("name", ["jacfwd", "jacrev", "hessian_fwd_rev", "hessian"])
def test_jacobians_match_cpu(name):
    def f(x):
        return (x.sin() * x).sum(0, keepdim=True) + x.exp() * x[0]

    transform = {
        "jacfwd": func.jacfwd,
        "jacrev": func.jacrev,
        "hessian_fwd_rev": lambda g: func.jacfwd(func.jacrev(lambda x: g(x).sum())),
        "hessian": lambda g: func.hessian(lambda x: g(x).sum()),
    }[name]
    x = torch.randn(3)
    torch.testing.assert_close(transform(f)(x.to("tpu")).cpu(), transform(f)(x), **TOL)


def test_functional_call_grad_and_vmap_match_cpu():
    m = _model()
    params = dict(m.named_parameters())
    x, y = torch.randn(6, 4), torch.randn(6, 5)

    def loss(p, x, y):
        return ((func.functional_call(m, p, (x,)) - y) ** 2).mean()

    per_sample = func.vmap(func.grad(loss), in_dims=(None, 0, 0))
    want = per_sample(params, x.unsqueeze(1), y.unsqueeze(1))
    m = _model().to("tpu")
    params_t = dict(m.named_parameters())
    got = per_sample(params_t, x.to("tpu").unsqueeze(1), y.to("tpu").unsqueeze(1))
    torch.testing.assert_close({k: v.cpu() for k, v in got.items()}, want, **TOL)


def test_fill_and_zero_through_overlapping_views_match_cpu():
    # torch lets fill_(number) and zero_ write a tensor whose elements share memory;
    # fill_(tensor) and other in-place ops refuse it.
    def run(device):
        x = torch.zeros(3, device=device)
        seen = []
        x.expand(4, 3).fill_(2.0)
        seen.append(x.tolist())
        x.expand(2, 3)[:, 1:].fill_(5)
        seen.append(x.tolist())
        x.expand(4, 3).zero_()
        seen.append(x.tolist())
        for refused in (lambda: x.expand(4, 3).add_(1), lambda: x.expand(2, 3).fill_(x[0])):
            with pytest.raises(RuntimeError, match="more than one element of the written-to"):
                refused()
        return seen

    assert run("tpu") == run("cpu")


_OVERLAPPING_COPIES = {
    "shifted": lambda x: x[1:].copy_(x[:-1]),
    "setitem shifted": lambda x: x.__setitem__(slice(1, None), x[:-1]),
    "transposed": lambda x: x.view(2, 2).t().copy_(x.view(2, 2)),
}


@pytest.mark.parametrize("name", sorted(_OVERLAPPING_COPIES))
def test_copy_refuses_a_partly_overlapping_source_as_cpu(name):
    # The result would depend on the order elements are written: torch refuses it.
    call = _OVERLAPPING_COPIES[name]
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            call(torch.arange(4.0, device=device))


def test_copy_from_disjoint_or_identical_memory_of_the_same_storage():
    for call in (
        lambda x: x[:2].copy_(x[2:]),
        lambda x: x.copy_(x),
        lambda x: x[::2].copy_(x[1::2]),
    ):
        want = torch.arange(4.0)
        call(want)
        got = torch.arange(4.0, device="tpu")
        call(got)
        assert torch.equal(got.cpu(), want)


def test_resize_of_a_view_reads_storage_order_and_stays_aliased():
    # CPU's resize_ keeps the storage and offset and takes contiguous strides.
    results = []
    for dev in ("cpu", "tpu"):
        x = torch.arange(24.0).reshape(4, 6).to(dev)
        transposed = x.t().resize_(24)  # storage order, not the transpose's
        base = torch.arange(12.0).reshape(2, 6).to(dev)
        row = base[1:].resize_(2, 3)
        row.fill_(-1)  # writes through to base's second row
        grown_base = torch.arange(6.0).to(dev)
        grown = grown_base[2:].resize_(3, 3)  # past the end: the storage grows
        grown[0].fill_(7)
        results.append(
            [
                transposed.cpu(),
                base.cpu(),
                grown_base.cpu(),
                torch.tensor([grown.storage_offset(), *grown.stride()]),
                grown[0].cpu(),
            ]
        )
    assert len(results[1]) == 5
    for got, want in zip(*reversed(results)):
        assert torch.equal(got, want)


def test_resize_of_a_dtype_view_grows_the_storage_under_it():
    results = []
    for dev in ("cpu", "tpu"):
        base = torch.arange(6.0, device=dev)
        grown = base.view(torch.int32).resize_(8)
        grown[6:] = 5
        shifted = torch.arange(6.0, device=dev)[1:].view(torch.int32).resize_(7)
        results.append([grown[:7].cpu(), base.cpu(), shifted[:5].cpu()])
    for got, want in zip(*reversed(results)):
        assert torch.equal(got, want)


def test_resize_to_a_memory_format_takes_its_strides():
    results = []
    for dev in ("cpu", "tpu"):
        empty = torch.empty(0, device=dev).resize_(2, 3, 4, 5, memory_format=torch.channels_last)
        data = torch.arange(6.0, device=dev).resize_(1, 2, 1, 3, memory_format=torch.channels_last)
        results.append((empty.stride(), data.stride(), data.cpu()))
    (cpu_empty, cpu_data, cpu_values), (empty, data, values) = results
    assert empty == cpu_empty == (60, 1, 15, 3)
    assert data == cpu_data
    assert torch.equal(values, cpu_values)


def test_resize_from_empty_and_of_unmade_zeros_computes_nothing():
    # A storage grown from nothing, or zeros grown with zeros, stays unmade until read
    # (torch.arange and every out= resized from empty write it whole next).
    torchjax.reset_stats()
    empty = torch.empty(0, device="tpu").resize_(3, 5)
    big = torch.zeros(300_000, device="tpu").resize_(300_007)
    got = torch.arange(1237, device="tpu")
    counts = torchjax.stats()
    assert counts["compiles"] == 0 and counts["executions"] == 0, counts
    assert torch.equal(empty.cpu(), torch.zeros(3, 5))
    assert torch.equal(big.cpu(), torch.zeros(300_007))
    assert torch.equal(got.cpu(), torch.arange(1237))


def test_resize_keeps_a_negative_zero_fill_in_the_old_elements():
    x = torch.zeros(300_000, device="tpu").fill_(-0.0)  # large: the fill is kept unmade
    x.resize_(300_004)
    got = x.cpu()
    assert torch.signbit(got[:300_000]).all() and not torch.signbit(got[300_000:]).any()
    assert torch.equal(got, torch.zeros(300_004))


@pytest.mark.parametrize(
    "src", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
)
@pytest.mark.parametrize(
    "dst",
    [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz],
    ids=str,
)
def test_float8_conversion_saturates_as_cpu(dst, src):
    # float8_e4m3fn has no infinity: CPU saturates to +-448 (NaN stays NaN); XLA's
    # conversion gives NaN. The other float8 types convert alike.
    values = [500.0, -1000.0, 449.0, 241.0, 0.3, -0.0, 1e6, 255.0]
    if src.is_floating_point:
        values += [float("inf"), -float("inf"), float("nan")]
    x = torch.tensor(values).to(src)
    want = x.to(dst).float()
    for got in (
        x.to("tpu").to(dst),
        torch.empty(len(x), dtype=dst, device="tpu").copy_(x.to("tpu")),
    ):
        got = got.cpu().float()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
        assert torch.equal(got.signbit() & ~got.isnan(), want.signbit() & ~want.isnan())


# Note [Memory formats on tpu] (torchjax/tensor/_memory_format.py): every op that makes a
# tensor "like" another reports CPU's strides for each memory format and input layout.
_FORMATS = {
    "preserve": torch.preserve_format,
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


def _layouts(dev):
    x4 = torch.arange(120.0, device=dev).reshape(2, 3, 4, 5)
    x5 = torch.arange(240.0, device=dev).reshape(2, 3, 4, 5, 2)
    return {
        "contiguous": x4,
        "transposed": x4.transpose(1, 3),
        "permuted": x4.permute(3, 1, 0, 2),
        "channels_last": x4.contiguous(memory_format=torch.channels_last),
        "channels_last_size1": torch.arange(6.0, device=dev)
        .reshape(2, 3, 1, 1)
        .contiguous(memory_format=torch.channels_last),
        "expanded": torch.arange(5.0, device=dev).expand(2, 3, 4, 5),
        "non_dense": x4[:, :, ::2, 1:],
        "permuted_non_dense": x4.permute(0, 2, 3, 1)[:, 1:],
        "channels_last_3d": x5.contiguous(memory_format=torch.channels_last_3d),
        "permuted_5d": x5.permute(4, 0, 2, 1, 3),
        "matrix_t": torch.arange(12.0, device=dev).reshape(3, 4).t(),
        "empty_permuted": x4.permute(0, 2, 3, 1)[..., :0],
        "empty_batch": x4[:0].permute(0, 3, 1, 2),
    }


# op(x, memory_format) -> result; the flag says whether values are defined.
_LIKE_OPS = {
    "clone": (lambda x, f: x.clone(memory_format=f), True),
    "contiguous": (lambda x, f: x.contiguous(memory_format=f), True),
    "empty_like": (lambda x, f: torch.empty_like(x, memory_format=f), False),
    "zeros_like": (lambda x, f: torch.zeros_like(x, memory_format=f), True),
    "ones_like": (lambda x, f: torch.ones_like(x, memory_format=f), True),
    "full_like": (lambda x, f: torch.full_like(x, 7, memory_format=f), True),
    "rand_like": (lambda x, f: torch.rand_like(x, memory_format=f), False),
    "randn_like": (lambda x, f: torch.randn_like(x, memory_format=f), False),
    "to_dtype": (lambda x, f: x.to(torch.float64, memory_format=f), True),
    "to_device": (lambda x, f: x.cpu().to(x.device, torch.float64, memory_format=f), True),
    "to_cpu": (lambda x, f: x.to("cpu", copy=True, memory_format=f), True),
    "empty": (lambda x, f: torch.empty(x.shape, device=x.device, memory_format=f), False),
    "new_empty": (lambda x, f: x.new_empty(x.shape), False),
}


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except RuntimeError as e:
        return "raises", str(e)


def _layout_of(t):
    flags = [_outcome(lambda f=f: t.is_contiguous(memory_format=f)) for f in _FORMATS.values()]
    view = _outcome(lambda: t.view(-1).shape)[0]  # torchjax's message names the op
    return t.shape, t.stride(), t.dtype, flags, view


@pytest.mark.parametrize("fmt", sorted(_FORMATS))
@pytest.mark.parametrize("op", sorted(_LIKE_OPS))
def test_memory_formats_give_cpu_strides(op, fmt):
    fn, defined = _LIKE_OPS[op]
    cpu_layouts, tpu_layouts = _layouts("cpu"), _layouts("tpu")
    compared = 0
    for name, x in cpu_layouts.items():
        want = _outcome(fn, x, _FORMATS[fmt])
        got = _outcome(fn, tpu_layouts[name], _FORMATS[fmt])
        assert got[0] == want[0], (name, got, want)
        compared += 1
        if want[0] == "raises":
            assert got[1].startswith(want[1]), name
            continue
        assert _layout_of(got[1]) == _layout_of(want[1]), name
        if defined:
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
    assert compared == len(cpu_layouts) > 0


_FROM_ZERO_DIM = {
    "tensor": lambda a, b, d: torch.tensor([a, b]),
    "tensor on device": lambda a, b, d: torch.tensor([a, b], device=d),
    "nested": lambda a, b, d: torch.tensor([[a, 1.0], [b, a]], dtype=torch.float64),
    "mixed with numbers": lambda a, b, d: torch.tensor([1, a, b]),
    "as_tensor": lambda a, b, d: torch.as_tensor([a, b], device=d),
    "new_tensor": lambda a, b, d: torch.ones(2, device=d).new_tensor([b, a]),
}


@pytest.mark.parametrize("name", sorted(_FROM_ZERO_DIM))
def test_tensor_from_a_list_of_zero_dim_tensors_matches_cpu(name):
    # torch reads each element with the Python key excluded: the read reaches the
    # PrivateUse1 kernel, which must give the value, as .item() does.
    def run(d):
        return _FROM_ZERO_DIM[name](torch.tensor(1.5, device=d), torch.tensor(3, device=d), d)

    want, got = run("cpu"), run("tpu")
    placed = name in ("tensor on device", "as_tensor", "new_tensor")
    assert got.device.type == ("tpu" if placed else "cpu")
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want)


def test_tensor_from_zero_dim_tensors_reports_a_queued_device_check():
    weight = torch.ones(3, 2, device="tpu")
    bad = torch.nn.functional.embedding(torch.tensor([0, 7], device="tpu"), weight)
    with pytest.raises(IndexError, match=r"index 7.*embedding|embedding.*index 7"):
        torch.tensor([bad[0, 0], bad[1, 0]])


def test_tensor_from_a_list_with_a_longer_tpu_tensor_refuses_as_cpu():
    for d in ("cpu", "tpu"):
        with pytest.raises(ValueError, match="only one element tensors"):
            torch.tensor([torch.ones(2, device=d), torch.tensor(1.0, device=d)])


def test_forward_mode_ad_gives_cpus_tangents():
    # make_dual asks for a tangent laid out as the primal
    # (aten::_new_zeros_with_same_feature_meta), here a transposed one.
    import torch.autograd.forward_ad as fwAD

    results = {}
    for device in ("cpu", "tpu"):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(device)
        tangent = torch.arange(12.0).reshape(4, 3).to(device).t()
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, tangent)
            y = (dual.sin() * 2).sum()
            z = dual[1:].exp()
            results[device] = (
                fwAD.unpack_dual(y).tangent.cpu(),
                fwAD.unpack_dual(z).tangent.cpu(),
                fwAD.unpack_dual(dual).tangent.stride(),
            )
    cpu, tpu = results["cpu"], results["tpu"]
    torch.testing.assert_close(tpu[0], cpu[0])
    torch.testing.assert_close(tpu[1], cpu[1])
    assert tpu[2] == cpu[2]


@pytest.mark.parametrize("batch_dims", [0, 1, 2])
def test_new_zeros_with_same_feature_meta_lays_out_as_cpu(batch_dims):
    out = {}
    for device in ("cpu", "tpu"):
        other = torch.randn(3, 4).to(device)[:, 1:].t()
        r = torch.ops.aten._new_zeros_with_same_feature_meta(
            torch.zeros(2, 5, 3, 4, device=device), other, self_num_batch_dims=batch_dims
        )
        out[device] = (r.shape, r.stride(), r.storage_offset(), r.untyped_storage().nbytes())
        assert not r.any()
    assert out["tpu"] == out["cpu"]


def test_linearize_is_refused_rather_than_traced_wrong():
    # make_fx over tpu tensors lost the tangent's chain: linearize's jvp gave zeros.
    x = torch.linspace(0, 1, 4, device="tpu")
    with pytest.raises(NotImplementedError, match="forward-mode AD under make_fx"):
        torch.func.linearize(torch.sin, x)
