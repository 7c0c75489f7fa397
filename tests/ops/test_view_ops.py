"""View ops (torchjax/ops/view_ops.py): OpInfo sweep plus aliasing, the heart of views.

Every aliasing test runs the same code on CPU and on tpu and compares the base tensor
afterwards: a write through any view must reach the base and every other live view.
"""

import pytest
import torch

from tests.ops.opinfo_cases import make_tests

OPS = [
    "view",
    "reshape",
    "reshape_as",
    "view_as",
    "permute",
    "transpose",
    "t",
    "expand",
    "expand_as",
    "squeeze",
    "squeeze.multiple",
    "unsqueeze",
    "select",
    "narrow",
    "split",
    "split.list_args",
    "split_with_sizes",
    "chunk",
    "unbind",
    "as_strided",
    "diagonal",
    "movedim",
    "flatten",
    "unflatten",
    "unfold",
    "view_as_real",
    "slice",
]
globals().update(make_tests(OPS))
# Forward only: its backward multiplies complex tensors (complex mul backward aborts the
# process in the autograd engine at the time of writing, outside this family).
test_opinfo_forward_view_as_complex = make_tests(["view_as_complex"])["test_opinfo_forward"]


def both(fn, make=lambda: torch.arange(24.0).reshape(2, 3, 4), strides=True):
    """Run ``fn(x)`` on CPU and on tpu; compare the result and ``x`` afterwards."""
    cx, tx = make(), make().to("tpu")
    cr, tr = fn(cx), fn(tx)
    for c, t in ((cx, tx), (cr, tr)):
        if isinstance(c, torch.Tensor):
            assert t.device.type == "tpu"
            assert t.shape == c.shape and t.dtype == c.dtype
            assert t.stride() == c.stride() or not strides
            torch.testing.assert_close(t.cpu(), c, rtol=0, atol=0)
    return tx, tr


def _add_(v):
    v.add_(torch.ones((), dtype=v.dtype, device=v.device))
    return v


@pytest.mark.parametrize(
    "make_view",
    [
        lambda x: x[0],
        lambda x: x.view(6, 4),
        lambda x: x.transpose(0, 2),
        lambda x: x.select(1, 2),
        lambda x: x.narrow(2, 1, 2),
        lambda x: x.unsqueeze(1),
        lambda x: x[:, ::2, 1::2],
        lambda x: x.as_strided((2, 2), (5, 7), 3),
        lambda x: x.permute(2, 0, 1)[1:],
        lambda x: x.diagonal(0, 1, 2),
        lambda x: x.t() if x.dim() == 2 else x.flatten(1).t(),
        lambda x: x.split(2, dim=2)[1],
        lambda x: x.unbind(1)[2],
        lambda x: x.movedim(0, 2).unflatten(0, (3, 1)),
        lambda x: x.expand(2, 2, 3, 4)[1],
        lambda x: x.squeeze().unfold(2, 2, 2)[..., 0],
    ],
    ids=[
        "getitem",
        "view",
        "transpose",
        "select",
        "narrow",
        "unsqueeze",
        "step_slice",
        "as_strided",
        "chained",
        "diagonal",
        "t",
        "split",
        "unbind",
        "movedim_unflatten",
        "expand_index",
        "unfold",
    ],
)
def test_inplace_through_view_reaches_base(make_view):
    both(lambda x: _add_(make_view(x)))


def test_x0_add_changes_x():
    x = torch.zeros(3, 2, device="tpu")
    x[0].add_(1)
    assert x.cpu().tolist() == [[1, 1], [0, 0], [0, 0]]


def test_every_live_view_sees_base_write():
    x = torch.arange(12.0).reshape(3, 4).to("tpu")
    views = [x.view(12), x.t(), x[1], x[:, 1:3], x.unsqueeze(0), x.as_strided((2,), (5,), 1)]
    x.mul_(torch.full((), 2.0, device="tpu"))
    c = torch.arange(12.0).reshape(3, 4) * 2
    expect = [c.view(12), c.t(), c[1], c[:, 1:3], c.unsqueeze(0), c.as_strided((2,), (5,), 1)]
    for v, e in zip(views, expect):
        torch.testing.assert_close(v.cpu(), e)


def test_write_through_one_view_seen_by_another():
    def fn(x):
        a, b = x.t(), x[:, 1]
        a[2].fill_(-1.0)
        return b.clone()

    both(fn, lambda: torch.arange(12.0).reshape(3, 4))


def test_copy_into_view():
    both(lambda x: x[:, 1].copy_(torch.full((2, 4), 5.0, device=x.device)))
    both(lambda x: x.transpose(1, 2)[0].copy_(torch.arange(12.0).reshape(4, 3)))


def test_slice_assignment():
    def fn(x):
        x[:, 1:3] = torch.full((2, 2, 4), 7.0, device=x.device)
        x[..., ::3] = 1.5
        return x

    both(fn)


def test_kv_cache_update():
    def fn(cache):
        for pos in range(3):
            k = torch.full((2, 4, 8), float(pos + 1), device=cache.device)
            cache[:, :, pos] = k
        return cache

    both(fn, lambda: torch.zeros(2, 4, 6, 8))


def test_inplace_view_ops():
    def fn(x):
        x.t_()
        x.unsqueeze_(0)
        x.squeeze_(0)
        x.transpose_(0, 1)
        return x

    both(fn, lambda: torch.arange(6.0).reshape(2, 3))


def test_as_strided_overlapping_read_and_write_error():
    x = torch.arange(6.0).to("tpu")
    v = x.as_strided((3, 2), (1, 1))
    torch.testing.assert_close(v.cpu(), torch.arange(6.0).as_strided((3, 2), (1, 1)))
    with pytest.raises(RuntimeError, match="more than one element"):
        v.add_(1.0)


def test_view_dtype_aliases():
    x = torch.arange(4.0)
    t = x.to("tpu")
    for dt in (torch.int32, torch.int16, torch.uint8, torch.float64):
        c, g = x.view(dt), t.view(dt)
        assert g.shape == c.shape and g.dtype == dt
        torch.testing.assert_close(g.cpu(), c)
    # An alias, as on CPU (Note [Views across dtypes]).
    t.view(torch.int32).zero_()
    x.view(torch.int32).zero_()
    torch.testing.assert_close(t.cpu(), x)


def test_view_as_real_complex_roundtrip():
    z = torch.randn(3, 2, dtype=torch.complex64)
    r = torch.view_as_real(z.to("tpu"))
    torch.testing.assert_close(r.cpu(), torch.view_as_real(z))
    torch.testing.assert_close(torch.view_as_complex(r).cpu(), z)


def test_empty_and_zero_d():
    both(lambda x: x.view(0, 3).t(), lambda: torch.zeros(0))
    both(lambda x: x.unsqueeze(0).expand(4), lambda: torch.tensor(2.0))
    both(lambda x: x.squeeze(0), lambda: torch.tensor(2.0))
    both(lambda x: x[2:1], lambda: torch.arange(5.0))


def test_int64_values_past_2_31():
    both(lambda x: x.view(2, 2).t()[1], lambda: torch.tensor([2**40, -(2**35), 3, 2**62]))


def test_view_errors():
    x = torch.zeros(2, 3, device="tpu")
    with pytest.raises(IndexError, match="select"):
        x.select(0, 5)
    with pytest.raises(IndexError, match="out of range"):
        x.unsqueeze(4)
    with pytest.raises(RuntimeError):
        x.t().view(6)
    with pytest.raises(RuntimeError, match="as_strided"):
        x.as_strided((4, 4), (4, 1))


def test_tensor_split_and_chunk():
    # OpInfo's tensor_split samples move the indices tensor to tpu, which torch refuses.
    both(lambda x: torch.tensor_split(x, 3, dim=2)[1])
    both(lambda x: torch.tensor_split(x, [1, 3], dim=2)[2])
    both(lambda x: torch.tensor_split(x, torch.tensor([1, 2]), dim=1)[1])
    both(lambda x: x.chunk(3, -1)[-1])


def test_as_strided_of_partial_view():
    # OpInfo's as_strided.partial_views samples are views that the harness clones away.
    both(lambda x: x.view(-1)[5:].as_strided((2, 2), (1, 2), 10).add_(1.0))


def test_split_copy_and_its_list_out():
    # aten::split_copy had no lowering; its ``Tensor(a!)[] out`` overload was checked on
    # meta with empty outs, which torch (never resizing those) rejected.
    results = {}
    for device in ("cpu", "tpu"):
        a = torch.arange(5.0, device=device)
        pieces = torch.split_copy(a, 3)
        assert not pieces[0]._is_view()
        outs = (torch.empty(3, device=device), torch.empty(2, device=device))
        torch.split_copy(a, 3, out=outs)
        with pytest.raises(RuntimeError, match="must match the size of tensor b"):
            torch.split_copy(a, 3, out=(torch.empty(2, device=device), outs[1]))
        results[device] = [p.cpu() for p in pieces] + [o.cpu() for o in outs]
    for c, t in zip(results["cpu"], results["tpu"]):
        torch.testing.assert_close(t, c)
