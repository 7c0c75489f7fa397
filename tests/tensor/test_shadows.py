"""Reads of small tpu tensors made from host data come from their host values (Note
[Host values of tensors made from host data] in torchjax/tensor/_shadows.py): the same
values as the device holds, for every view, until a write; no device-to-host read."""

import pytest
import torch

import torchjax
from torchjax.tensor import _shadows


def _reads():
    return torchjax.stats()["host_reads"]


def _views(t):
    return [t, t.t(), t[:, 1], t[1], t[1, 2], t.reshape(-1)[::2], t.detach()]


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16]
)
def test_reads_of_views_equal_the_device_values_without_a_read(dtype):
    cpu = torch.arange(6).reshape(2, 3).to(dtype)
    t = cpu.to("tpu")
    before = _reads()
    got = [(v.tolist(), v.cpu(), v.item() if v.numel() == 1 else None) for v in _views(t)]
    assert _reads() == before
    want = [(v.tolist(), v, v.item() if v.numel() == 1 else None) for v in _views(cpu)]
    assert len(got) == len(want) == 7
    for (gl, gc, gi), (wl, wc, wi) in zip(got, want):
        assert gl == wl and gi == wi
        assert gc.dtype == wc.dtype and gc.shape == wc.shape and torch.equal(gc, wc)
        assert gc.stride() == wc.clone().stride()  # laid out as .cpu() of a CUDA tensor


def test_python_ints_made_into_tensors_read_without_a_transfer():
    eos = torch.tensor([2, 7], device="tpu")
    pad = torch.tensor(0, device="tpu")
    before = _reads()
    assert eos.reshape(-1).tolist() == [2, 7] and int(pad) == 0 and bool(eos[1] == 7)
    # The comparison ran on the host values too (Note [Integer ops on host values]).
    assert _reads() == before
    x = torch.tensor([2.5, 7.0], device="tpu")
    assert bool(x[1] == 7)  # a float input: the comparison is a device result, one read
    assert _reads() == before + 1


def test_a_write_makes_reads_go_to_the_device():
    t = torch.tensor([1, 2, 3], device="tpu")
    t[0] = 5
    before = _reads()
    assert t.tolist() == [5, 2, 3]
    assert _reads() == before + 1
    u = torch.tensor([1.0, 2.0], device="tpu")
    u.add_(1)
    assert u.tolist() == [2.0, 3.0]


def test_views_of_another_dtype_and_math_bits_read_the_device():
    t = torch.tensor([1, 2], dtype=torch.int64, device="tpu")
    before = _reads()
    assert t.view(torch.int32).tolist() == [1, 0, 2, 0]
    z = torch.tensor([1 + 2j], device="tpu")
    assert z.conj().tolist() == [1 - 2j]
    assert _reads() == before + 2


def test_large_tensors_keep_no_host_copy():
    n = _shadows.SHADOW_BYTES // 4 + 1
    t = torch.ones(n, dtype=torch.float32).to("tpu")
    before = _reads()
    assert t.sum().item() == n and t[0].item() == 1.0
    assert _reads() == before + 2


def test_a_pending_device_check_raises_at_a_read_from_host_values():
    x = torch.arange(5, device="tpu")
    ids = torch.tensor([7], device="tpu")
    small = torch.tensor([3], device="tpu")
    x[ids]  # an out-of-range index: a deferred device check, raised at the next sync
    with pytest.raises(IndexError):
        small.tolist()


def _unmade(t) -> bool:
    return isinstance(t._storage.lazy, _shadows.HostValues)


def test_small_copies_are_put_on_the_device_when_a_device_op_first_reads_them():
    # Note [Host values put on the device when first read]: a small copy into a new
    # tensor waits on the host; the first device op puts it as the copy would have.
    before = torch.tpu.memory_allocated()
    ids = torch.tensor([[3, 1, 4]], device="tpu")
    half = torch.tensor([0.5, 1.5]).to("tpu")
    assert _unmade(ids) and _unmade(half)
    assert torch.tpu.memory_allocated() - before == 3 * 8 + 2 * 4  # counted from the start
    assert ids.tolist() == [[3, 1, 4]] and ids.detach().tolist() == [[3, 1, 4]]
    assert _unmade(ids)  # reads and aliases leave it on the host
    got = half * 2  # a device op
    assert not _unmade(half) and got.tolist() == [1.0, 3.0]
    want = torch.tensor([0.5, 1.5]).to("tpu")
    want._storage.arr  # noqa: B018 - as a copy made its array
    arr, ref = half._value(), want._value()
    assert (arr.dtype, arr.committed, arr.sharding) == (ref.dtype, ref.committed, ref.sharding)
    reads = _reads()
    assert half.tolist() == [0.5, 1.5] and _reads() == reads  # still the shadow
    # Not deferred: a large copy, a copy into a tensor whose array exists, a trace's.
    assert not _unmade(torch.zeros(300).to("tpu"))
    made = torch.zeros(2, device="tpu") + 1
    made.copy_(torch.tensor([4.0, 5.0]))
    assert not _unmade(made) and made.tolist() == [4.0, 5.0]
    seen = []
    torchjax.jit(lambda x: seen.append(_unmade(torch.tensor([1, 2], device="tpu"))) or x + 1)(
        torch.ones(2, device="tpu")
    )
    assert seen == [False]
