"""Index writes at a run of positions (torchjax/ops/index_runs.py): KV-cache-shaped
``index_copy_`` and ``x[:, :, idx] = v`` give CPU's values and errors, eager and under
``torchjax.jit``, and a write whose positions are known to be a run is lowered as a
dynamic-update-slice, not a scatter (Note [Index writes at a run of positions])."""

import pytest
import torch

import torchjax
from tests._programs import lowered, scatters

SHAPE = (2, 3, 8, 4)  # (batch, heads, positions, head size): writes along dim 2


def _cache():
    return torch.arange(float(torch.Size(SHAPE).numel())).reshape(SHAPE)


def _keys(n, seed=0):
    return torch.randn(2, 3, n, 4, generator=torch.Generator().manual_seed(seed))


def _scatters(jitted) -> int:
    (text,) = lowered(jitted)
    return scatters(text)


def _copy(pos):
    def write(cache, k):
        cache.index_copy_(2, pos(cache.device), k)
        return cache

    return write


def _put(pos):
    def write(cache, k):
        cache[:, :, pos(cache.device)] = k
        return cache

    return write


def _tensor(values, dtype=torch.int64):
    return lambda device: torch.tensor(values, dtype=dtype, device=device)


def _on_cpu(values):
    return lambda device: torch.tensor(values)  # a CPU index for a tpu tensor


def _arange(start, end):
    # Made from constants: inside a trace its values are known (Note [Values made from
    # constants inside a trace]).
    return lambda device: torch.arange(start, end, device=device)


# (write, new positions, lowered as a slice write)
CASES = {
    "index_copy one position": (_copy(_tensor([5])), 1, True),
    "index_copy a 0-d position": (_copy(_tensor(7)), 1, True),
    "index_copy one position on CPU": (_copy(_on_cpu([0])), 1, True),
    "index_copy a run of constants": (_copy(_arange(3, 7)), 4, True),
    "index_copy a run on CPU": (_copy(_on_cpu([4, 5, 6])), 3, True),
    "index_copy the whole dim": (_copy(_arange(0, 8)), 8, True),
    "index_copy descending": (_copy(_tensor([5, 4])), 2, False),
    "index_copy with a gap": (_copy(_on_cpu([1, 3])), 2, False),
    "index_put one position": (_put(_tensor([2])), 1, True),
    "index_put a negative position": (_put(_tensor([-3])), 1, True),
    "index_put an int32 position": (_put(_tensor([6], torch.int32)), 1, True),
    "index_put a run of constants": (_put(_arange(1, 6)), 5, True),
    "index_put a negative run on CPU": (_put(_on_cpu([-2, -1])), 2, True),
    "index_put across the end": (_put(_on_cpu([-1, 0])), 2, False),
    "index_put with a gap": (_put(_tensor([0, 2, 4])), 3, False),
}


def _jitted_into_tpu_cache(write, *args):
    """``write`` under torchjax.jit on a tpu copy of the cache: the cache after the call
    and the jitted function (for its program)."""
    jitted = torchjax.jit(write)
    cache = _cache().to("tpu")
    jitted(cache, *(a.to("tpu") for a in args))
    return cache, jitted


@pytest.mark.parametrize("name", list(CASES))
def test_writes_match_cpu_eager_and_jitted(name):
    write, n, as_slice = CASES[name]
    k = _keys(n)
    expected = write(_cache(), k)
    assert torch.equal(write(_cache().to("tpu"), k.to("tpu")).cpu(), expected)
    cache, jitted = _jitted_into_tpu_cache(write, k)
    assert torch.equal(cache.cpu(), expected)
    found = _scatters(jitted)
    assert (found == 0) if as_slice else (found > 0), found


def test_positions_traced_as_arguments_keep_the_scatter_unless_one():
    # Traced positions have no values at trace time: only one position is known to be a
    # run (its shape says so).
    def write(cache, pos, k):
        cache.index_copy_(2, pos, k)

    for n, expected_scatters in ((1, 0), (3, 1)):
        pos, k = torch.arange(2, 2 + n), _keys(n)
        expected = _cache().index_copy_(2, pos, k)
        cache, jitted = _jitted_into_tpu_cache(write, pos, k)
        assert torch.equal(cache.cpu(), expected)
        assert _scatters(jitted) == expected_scatters


def test_duplicate_positions_are_not_a_run_and_match_cpu():
    # The same value written twice at one position: the result does not depend on which
    # write wins.
    k = _keys(1).expand(2, 3, 2, 4).contiguous()
    for write in (_copy(_on_cpu([3, 3])), _put(_on_cpu([3, 3]))):
        expected = write(_cache(), k)
        assert torch.equal(write(_cache().to("tpu"), k.to("tpu")).cpu(), expected)
        cache, jitted = _jitted_into_tpu_cache(write, k)
        assert torch.equal(cache.cpu(), expected)
        assert _scatters(jitted) > 0


# (write, new positions, the index named in the error); CPU raises IndexError for each.
OUT_OF_RANGE = {
    "index_copy one position past the end": (_copy(_tensor([8])), 1, 8),
    "index_copy a negative position": (_copy(_tensor([-1])), 1, -1),
    "index_put one position past the end": (_put(_tensor([8])), 1, 8),
    "index_put one position before the start": (_put(_tensor([-9])), 1, -9),
    "index_copy a run of constants past the end": (_copy(_arange(5, 9)), 4, 8),
    "index_put a run on CPU past the end": (_put(_on_cpu([7, 8])), 2, 8),
}


@pytest.mark.parametrize("immediate", [False, True], ids=["deferred", "immediate"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_out_of_range_positions_raise_as_cpu(name, compiled, immediate):
    write, n, bad = OUT_OF_RANGE[name]
    k = _keys(n)
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds for dimension "):
        write(_cache(), k)
    # The text eager raised before these writes were slices (CPU's index_put numbers the
    # dim among the index tensors: "dimension 0").
    op = "index_copy" if name.startswith("index_copy") else "index_put"
    text = rf"index {bad} is out of bounds for dimension 2 with size 8 \(in aten::{op}\)"
    run = torchjax.jit(write) if compiled else write
    torch.tpu.set_sync_checks(immediate)
    try:
        with pytest.raises(IndexError, match=text):
            run(_cache().to("tpu"), k.to("tpu"))
            torch.tpu.synchronize()
    finally:
        torch.tpu.set_sync_checks(False)


def test_a_loop_of_one_position_writes_matches_cpu_and_raises_past_the_end():
    # A decode loop: one program (Jitted.repeat) writing the position it carries, which
    # the write's dynamic-update-slice would clamp; its range check raises past the end.
    @torchjax.jit
    def step(cache, pos, k):
        cache.index_copy_(2, pos.reshape(1), k)
        pos.add_(1)
        k.add_(1.0)

    def on_cpu(times):
        cache, k = _cache(), _keys(1)
        for pos in range(times):
            cache.index_copy_(2, torch.tensor([pos]), k)
            k.add_(1.0)
        return cache

    cache, pos, k = _cache().to("tpu"), torch.tensor(0, device="tpu"), _keys(1).to("tpu")
    step.repeat(8, cache, pos, k)
    assert torch.equal(cache.cpu(), on_cpu(8))
    assert _scatters(step) == 0
    with pytest.raises(IndexError, match="index 8 is out of bounds for dimension 2 with size 8"):
        on_cpu(9)
    pos.zero_()
    with pytest.raises(IndexError, match=r"index 8 is out of bounds .*\(in aten::index_copy\)"):
        step.repeat(9, cache, pos, k)
        torch.tpu.synchronize()
