"""Host-backed tpu storages: views of their bytes and snapshots of tpu data."""

import torch

import torchjax  # noqa: F401
from torchjax.tensor import _host_storage


def test_host_view_passes_cpu_and_jax_tensors_through():
    cpu, tpu = torch.ones(2), torch.ones(2).to("tpu")
    assert _host_storage.host_view(cpu) is cpu and _host_storage.host_view(tpu) is tpu


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
