"""Integer and bool ops on tpu tensors whose values the host holds run on the host (Note
[Integer ops on host values] in torchjax/ops/host_ops.py): CPU's values, dtypes, strides
and errors, no device program and no read back; everything else runs on the device."""

import pytest
import torch

import torchjax
from torchjax.device import _checks

TPU = "tpu"


def _counts():
    s = torchjax.stats()
    return s["host_ops"], s["executions"], s["host_reads"]


def _bookkeeping(ids, pad, eos):
    """transformers' generate setup, in miniature: masks, position ids, checks."""
    mask = (ids != pad).long()
    pos = mask.cumsum(-1) - 1
    pos = pos.masked_fill(mask == 0, 1)
    has_eos = torch.isin(ids, eos).any()
    left = (mask[:, 0] == 0).any()
    rows = torch.stack([mask.sum(-1), pos.amax(-1)], dim=0)
    return mask, pos, has_eos, left, rows, torch.cat([ids, pos], dim=-1).flip(-1)


def test_bookkeeping_runs_on_the_host_with_cpus_results():
    cpu = (torch.tensor([[0, 0, 5, 6], [1, 2, 3, 2]]), torch.tensor(0), torch.tensor([2, 9]))
    tpu = [t.to(TPU) for t in cpu]
    torchjax.reset_stats()
    got = _bookkeeping(*tpu)
    ops, executions, reads = _counts()
    assert ops >= 12 and executions == 0
    want = _bookkeeping(*cpu)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert g.device.type == TPU and g.dtype == w.dtype and g.stride() == w.stride()
        assert g.tolist() == w.tolist()
    assert _counts()[2] == 0  # the reads came from the host values
    assert bool(got[2]) and bool(got[3])


def test_other_calls_run_on_the_device():
    ids = torch.tensor([[1, 2], [3, 4]]).to(TPU)
    torchjax.reset_stats()
    half = ids * 0.5  # a float result: run on the device
    floats = torch.tensor([1.5, 2.5]).to(TPU) + 1  # a float input
    made = torch.arange(4, device=TPU) + 1  # no host values: made on the device
    assert _counts()[0] == 0 and _counts()[1] == 3
    assert half.tolist() == [[0.5, 1.0], [1.5, 2.0]] and floats.tolist() == [2.5, 3.5]
    assert made.tolist() == [1, 2, 3, 4]
    ids[0, 0] = 7  # a write: the device holds the values now
    torchjax.reset_stats()
    assert (ids + 1).tolist() == [[8, 3], [4, 5]]
    assert _counts()[0] == 0 and _counts()[2] == 1


def test_traces_do_not_take_host_values():
    # Inside torchjax.jit a host value would be a constant of the program: the ops are
    # traced, and a new value gives the new result.
    f = torchjax.jit(lambda ids: (ids != 0).long().cumsum(-1))
    for row in ([0, 3, 4], [5, 0, 6]):
        ids = torch.tensor([row]).to(TPU)
        torchjax.reset_stats()
        assert f(ids).tolist() == (torch.tensor([row]) != 0).long().cumsum(-1).tolist()
        assert _counts()[0] == 0


def test_errors_are_cpus_after_earlier_device_failures():
    a, zero = torch.tensor([4, 6]), torch.tensor([1, 0])
    with pytest.raises(RuntimeError) as cpu:
        torch.remainder(a, zero)
    with pytest.raises(RuntimeError) as got:
        torch.remainder(a.to(TPU), zero.to(TPU))
    assert str(got.value) == str(cpu.value)
    # A failure queued on the device before the op is reported first.
    torch.index_select(torch.randn(5, 3, device=TPU), 0, torch.arange(8, 9, device=TPU))
    assert _checks.pending() == 1
    with pytest.raises(IndexError, match="index 8 is out of bounds"):
        torch.remainder(a.to(TPU), zero.to(TPU))
    assert _checks.pending() == 0


def test_conversions_stay_on_the_device_they_name():
    ids = torch.tensor([[0, 1], [2, 0]]).to(TPU)
    torchjax.reset_stats()
    as_bool = ids.to(torch.bool)
    moved = ids.to("cpu", torch.int32)  # a read, from the host values
    as_float = ids.to(torch.float32)  # a float result: on the device
    assert as_bool.device.type == TPU and as_bool.tolist() == [[False, True], [True, False]]
    assert moved.device.type == "cpu" and moved.dtype == torch.int32
    assert as_float.tolist() == [[0.0, 1.0], [2.0, 0.0]]
    assert _counts()[0] == 1


def _on_host(t) -> bool:
    from torchjax.tensor import _shadows

    return isinstance(t._storage.lazy, _shadows.HostValues)


def test_results_are_put_on_the_device_when_a_device_op_first_reads_them():
    # Note [Host values put on the device when first read]: a chain of host ops and its
    # reads never transfer; the first device op puts the values, placed as a copy would
    # be, and the host values stay the shadow of that array.
    mask = torch.tensor([[1, 1, 0, 1]]).to(TPU)
    before = torch.tpu.memory_allocated()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert _on_host(pos) and pos.tolist() == [[0, 1, 0, 2]]
    assert torch.tpu.memory_allocated() > before  # counted from the start, as any tensor
    torchjax.reset_stats()
    scaled = pos * 2.5  # a float result: a device op, which puts pos
    assert not _on_host(pos) and _counts() == (0, 1, 0)
    arr = pos._value()
    want = torch.tensor([[0, 1, 0, 2]]).to(TPU)._value()
    assert (arr.dtype, arr.committed, arr.sharding) == (want.dtype, want.committed, want.sharding)
    assert pos.tolist() == [[0, 1, 0, 2]] and _counts()[2] == 0  # still from the host
    assert scaled.tolist() == [[0.0, 2.5, 0.0, 5.0]]
    pos.add_(1)  # a write: the device holds the values now
    torchjax.reset_stats()
    assert pos.tolist() == [[1, 2, 1, 3]] and _counts()[2] == 1


def test_results_under_a_mesh_are_put_at_once():
    mask = torch.tensor([[1, 0, 1]]).to(TPU)
    made_outside = mask.cumsum(-1)
    with torchjax.mesh((1,), ("x",)):
        inside = mask.cumsum(-1)
        assert not _on_host(inside) and inside.tolist() == [[1, 1, 2]]
        # Made outside, first read inside: placed as outside (on one device, uncommitted).
        arr = (made_outside + 0.5)._value()
        assert made_outside._value().sharding == mask._value().sharding
    assert arr.tolist() == [[1.5, 1.5, 2.5]]
