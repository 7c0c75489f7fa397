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
