"""torch.tpu: the device module users reach for as they would torch.cuda."""

import torch

import torchjax  # noqa: F401


def test_basic_queries():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    assert torch.bfloat16 in torch.tpu.get_amp_supported_dtype()


def test_synchronize_blocks():
    x = torch.randn(64, 64, device="tpu")
    y = x @ x
    torch.tpu.synchronize()
    assert y._value().is_ready()


def test_manual_seed_reproducible():
    torch.manual_seed(123)
    a = torch.rand(5, device="tpu").cpu()
    b = torch.rand(5, device="tpu").cpu()
    torch.manual_seed(123)
    a2 = torch.rand(5, device="tpu").cpu()
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)
    torch.tpu.manual_seed(7)
    c = torch.rand(3, device="tpu").cpu()
    torch.tpu.manual_seed_all(7)
    assert torch.equal(c, torch.rand(3, device="tpu").cpu())


def test_rng_state_roundtrip():
    torch.manual_seed(0)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.randn(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(a, torch.randn(4, device="tpu").cpu())
    # The argument forms torch.random.fork_rng uses.
    s2 = torch.tpu.get_rng_state("tpu:0")
    torch.tpu.set_rng_state(s2, "tpu:0")
    torch.tpu.set_rng_state(s2, device=0)


def test_fork_rng_restores_tpu_state():
    torch.manual_seed(5)
    with torch.random.fork_rng(device_type="tpu"):
        torch.rand(3, device="tpu")
    after = torch.rand(3, device="tpu").cpu()
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3, device="tpu").cpu())


def test_set_rng_state_rejects_garbage():
    import pytest

    with pytest.raises(RuntimeError, match="get_rng_state"):
        torch.tpu.set_rng_state(torch.zeros(3))


def test_memory_stats():
    # Written, so its array exists (a new torch.ones this large holds none until read:
    # Note [Storages filled on first read]).
    x = torch.randn(1024, 1024, device="tpu")
    stats = torch.tpu.memory_stats()
    assert isinstance(stats, dict) and stats["bytes_in_use"] >= x.numel() * 4
    assert torch.tpu.memory_allocated() >= x.numel() * 4
    assert torch.tpu.max_memory_allocated() >= x.numel() * 4
    torch.tpu.empty_cache()


def test_memory_allocated_counts_tensors_not_read_yet():
    # A large torch.ones holds no array until read (Note [Storages filled on first
    # read]); memory_allocated counts it from its creation, as CUDA does, and stops
    # counting it when it dies.
    n = 1 << 21
    # The fill value's kept device scalar (Note [Python numbers as device scalars]) is
    # made by the first such call of the process: made before the count starts.
    torch.ones(n, device="tpu").add_(1)
    before = torch.tpu.memory_allocated()
    x = torch.ones(n, device="tpu")
    assert torch.tpu.memory_stats()["bytes_unfilled"] >= n * 4
    assert torch.tpu.memory_allocated() - before == n * 4
    x.add_(1)  # now an array: counted once, not twice
    assert torch.tpu.memory_allocated() - before == n * 4
    del x
    assert torch.tpu.memory_allocated() == before


def test_autocast_tpu():
    a = torch.randn(4, 4, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        b = a @ a
    assert b.dtype == torch.bfloat16


def test_cuda_like_extras():
    props = torch.tpu.get_device_properties(0)
    assert props.name and props.total_memory > 0
    free, total = torch.tpu.mem_get_info()
    assert 0 <= free <= total
    torch.tpu.reset_peak_memory_stats()
    torch.tpu.init()


def test_invalid_ordinal_is_a_clear_error():
    import pytest

    bad = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match=f"invalid device ordinal tpu:{bad}"):
        torch.ones(1, device=f"tpu:{bad}")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.ones(1).to(f"tpu:{bad}")
