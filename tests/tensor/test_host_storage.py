"""Host-backed tpu storages: views of their bytes and snapshots of tpu data."""

import torch

import torchjax  # noqa: F401
from torchjax.tensor import _host_storage


def test_host_view_passes_cpu_and_jax_tensors_through():
    cpu, tpu = torch.ones(2), torch.ones(2).to("tpu")
    for t in (cpu, tpu):
        assert _host_storage.host_view(t, reading=True) is t


def test_torch_copies_a_host_backed_storage_through_a_plain_tpu_tensor():
    # storage.cpu() and the legacy writer copy through a plain tpu tensor over the
    # storage, which host_view reads as the CPU bytes behind it.
    cpu = torch.arange(6, dtype=torch.int32)
    storage = _host_storage.host_backed(cpu.untyped_storage(), torch.device("tpu", 0))
    assert storage.device.type == "tpu" and _host_storage.host_of(storage) is not None
    back = storage.cpu()
    assert back.device.type == "cpu" and bytes(back) == bytes(cpu.untyped_storage())
    assert back.data_ptr() != cpu.untyped_storage().data_ptr()  # a copy, as torch's


def test_snapshot_is_shared_while_the_root_is_unchanged():
    t = torch.arange(4.0).to("tpu")
    first = t[1:].__reduce_ex__(2)[1][0]._untyped_storage
    again = t.__reduce_ex__(2)[1][0]._untyped_storage
    assert again is first and bytes(first.cpu()) == bytes(torch.arange(4.0).untyped_storage())
    t.add_(1)  # a write: the next pickle reads the new bytes
    after = t.__reduce_ex__(2)[1][0]._untyped_storage
    assert after is not first
    assert bytes(after.cpu()) == bytes(torch.arange(1.0, 5.0).untyped_storage())
    assert _host_storage.loaded(after)[torch.float32] is t._storage


def test_a_storage_bound_to_a_tensor_reads_the_tensors_data():
    # deepcopy clones through a tensor bound to the new storage: its data lives in that
    # tensor's array, and every way torch reads the storage sees it.
    import copy
    import io

    s = torch.arange(4, dtype=torch.uint8).untyped_storage().tpu()
    d = copy.deepcopy(s)
    assert list(d.cpu()) == [0, 1, 2, 3]
    typed = torch.TypedStorage(wrap_storage=d, dtype=torch.uint8, _internal=True)
    for zipfile in (True, False):  # the legacy writer reads through a plain tpu tensor
        buf = io.BytesIO()
        torch.save(typed, buf, _use_new_zipfile_serialization=zipfile)
        buf.seek(0)
        back = torch.load(buf, map_location="cpu", weights_only=False)
        assert list(back) == [0, 1, 2, 3], zipfile
