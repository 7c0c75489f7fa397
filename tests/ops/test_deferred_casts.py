"""Conversions of small tensors computed inside their consumers' programs
(torchjax/ops/deferred_casts.py, Note [Conversions read by their consumers]): values as
CPU's and as the conversion made at the call, bit for bit; the converted tensor read any
other way; what is not deferred; and the programs it saves."""

import os

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import torchjax
from tests._child import run_python
from torchjax.ops import cached_compute, deferred_casts, executables

TPU = "tpu"
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


@pytest.fixture(autouse=True)
def _fresh_caches():
    executables.clear_caches()


def _deferred(t) -> bool:
    return isinstance(t._storage.lazy, deferred_casts.Cast)


def _values(dtype):
    # Values every dtype holds, and (for floats) values that round or truncate: 2.5, 1e-3.
    x = torch.tensor([[0.0, 1.0, 2.5, 3.0], [127.0, 1e-3, 0.0, 5.0], [1.0, 0.0, 9.0, 7.0]])
    if not (dtype.is_floating_point or dtype == torch.bool):
        x = x.trunc()
    return x.to(dtype)


def _on_device(x):
    """``x`` on tpu with its values on the device alone: integer conversions of values
    the host holds run there instead (Note [Integer ops on host values]); a device write
    drops the host's copy."""
    t = x.to(TPU)
    t.copy_(t.clone())
    return t


def _bits(t):
    t = t.cpu()
    ints = {torch.float16: torch.int16, torch.bfloat16: torch.int16}
    ints.update({torch.float32: torch.int32, torch.float64: torch.int64})
    return t.view(ints[t.dtype]) if t.dtype in ints else t


@pytest.mark.parametrize(
    ("src", "dst"),
    [(s, d) for d in DTYPES for s in DTYPES if s != d],  # a conversion: two dtypes
    ids=lambda dt: str(dt),
)
def test_a_deferred_conversion_gives_cpus_values(src, dst):
    x = _values(src)
    t = _on_device(x).to(dst)
    if src == torch.bool and dst.is_floating_point:
        # Converted behind a barrier, which no consumer admits: made at the call.
        assert not _deferred(t) and torch.equal(_bits(t), _bits(x.to(dst)))
        return
    assert _deferred(t) and t.dtype == dst and t.stride() == x.stride()
    got = F.pad(t, (1, 2))  # converted inside the padding's program: it is elementwise
    assert _deferred(t)
    assert got.dtype == dst and torch.equal(_bits(got), _bits(F.pad(x.to(dst), (1, 2))))
    # Read on its own: made once, then held.
    assert torch.equal(_bits(t), _bits(x.to(dst)))
    assert t._storage.lazy is None


# NaN, infinities, signed zeros, float32/float16/bfloat16 subnormals, halfway cases of
# the half types, values past every integer type's range and past float16's, integers
# that float32 and float64 round.
_SPECIAL_FLOATS = [0.0, -0.0, 0.5, 1.5, -2.5, 1 / 3, 65504.0, 65520.0, 70000.0, 3.4e38]
_SPECIAL_FLOATS += [1e39, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 6e-8]
_SPECIAL_FLOATS += [9.2e-41, 1.0000001, 255.0, 256.0, -129.0, 2.0**31, -(2.0**31) - 1]
_SPECIAL_FLOATS += [2.0**63, -(2.0**63), 2.0**64, 2.0**53 + 1, 1e300, 1e-310, -4e9]
_SPECIAL_INTS = [0, 1, -1, 127, 128, 255, 256, -129, 2**31 - 1, 2**31, -(2**31) - 1]
_SPECIAL_INTS += [2**53 + 1, 2**62 + 12345, -(2**63), 2**63 - 1, 65505, 16777217]

# Consumers of each kind: one that moves elements (pad), arithmetic (in opmath for
# half types), a comparison at a rounding boundary and a promotion to a wider dtype, all
# elementwise (the conversion inside), and a reduction (refused: made first).
_CONSUMERS = {
    "pad": lambda t: F.pad(t, (1, 2), value=1),
    "mul": lambda t: t * t,
    "compare": lambda t: t == 16777216.0,
    "promote": lambda t: t + torch.zeros(t.shape, dtype=torch.float64, device=TPU),
    "sum": lambda t: t.sum(),
}


def grid_mismatches() -> list:
    """Every pair of dtypes, on the special values, read by each consumer: where the
    deferred conversion's result differs from the conversion made at the call (dtype,
    bits or error)."""
    bad = []
    for src in DTYPES:
        x = torch.tensor(_SPECIAL_FLOATS if src.is_floating_point else _SPECIAL_INTS)
        t = _on_device(x.to(src))
        for dst in DTYPES:
            for name, consumer in _CONSUMERS.items() if dst != src else ():
                results = []
                for limit in (-1, deferred_casts.MAX_BYTES):  # deferral off, then on
                    before, deferred_casts.MAX_BYTES = deferred_casts.MAX_BYTES, limit
                    try:
                        converted = t.to(dst)
                    finally:
                        deferred_casts.MAX_BYTES = before
                    made = limit < 0 or (src == torch.bool and dst.is_floating_point)
                    assert _deferred(converted) != made, (src, dst)
                    try:
                        got = consumer(converted)
                        results.append((got.dtype, _bits(got).tolist()))
                    except Exception as e:  # the error must be the same one
                        results.append((type(e), str(e)))
                if results[0] != results[1]:
                    bad.append(f"{src} -> {dst}, {name}: made {results[0]}, deferred {results[1]}")
    return bad


def test_deferred_conversions_give_the_values_made_at_the_call_bit_for_bit():
    # As user code compiles, at XLA's defaults, in a child process: the suite compiles at
    # level 0 (Note [Compile speed in the suite] in tests/conftest.py), where XLA:CPU
    # flushes a bfloat16 subnormal converted to bool in some programs and not in others
    # (by the array's length: already so for the conversion made at the call).
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        flags = flags.replace(flag, "")
    out = run_python(
        """
        from tests.ops.test_deferred_casts import grid_mismatches
        print("BAD", grid_mismatches())
        """,
        env={"XLA_FLAGS": flags.strip()},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "BAD []" in out.stdout, out.stdout[-4000:]


def test_a_reduction_makes_the_conversion_first(monkeypatch):
    # XLA:CPU fuses a conversion into a reduction and drops its rounding: a bfloat16 sum
    # and softmax of a float32 (128, 64) converted inside were the float32 ones rounded
    # once, up to 0.49 away. Not elementwise: refused, the conversion made first.
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * 1000
    src = x.to(TPU)
    for consumer in (lambda t: t.sum(0), lambda t: t.softmax(-1)):
        t = src.to(torch.bfloat16)
        assert _deferred(t)
        got = consumer(t)
        assert torch.equal(_bits(got), _bits(consumer(x.to(torch.bfloat16))))
        assert not _deferred(t)


def test_a_random_op_draws_as_with_the_conversion_made(monkeypatch):
    # A random op makes its conversions first, and a refused call made again draws from
    # the counter value it reserved: with neither, this draw and every later one moved.
    x = torch.randn(4, 8).to(TPU).half()
    draws = []
    for limit in (-1, deferred_casts.MAX_BYTES):
        monkeypatch.setattr(deferred_casts, "MAX_BYTES", limit)
        torch.manual_seed(0)
        converted = x.to(torch.float32)
        assert _deferred(converted) == (limit > 0)
        draws.append([F.dropout(converted, 0.5).cpu(), torch.rand(3, device=TPU).cpu()])
    assert all(torch.equal(a, b) for a, b in zip(*draws))


def test_float_roundings_are_torchs_bit_for_bit():
    # float32 -> bfloat16/float16 inside a consumer rounds as the conversion alone does
    # (XLA keeps a conversion's rounding: excess precision off).
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * 300
    for dst in (torch.bfloat16, torch.float16):
        t = x.to(TPU).to(dst)
        assert _deferred(t)
        got = t * t + t
        want = x.to(dst) * x.to(dst) + x.to(dst)
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


def test_views_writes_and_host_reads_of_a_deferred_result():
    x = _values(torch.float32)
    want = x.to(torch.int64)
    t = x.to(TPU).to(torch.int64)
    assert torch.equal(t[1:, 2].cpu(), want[1:, 2])  # a view: the array is made
    t = x.to(TPU).to(torch.int64)
    t[0, 1] = 40  # a partial write
    want[0, 1] = 40
    assert torch.equal(t.cpu(), want)
    t = x.to(TPU).to(torch.int64)
    t.copy_(torch.full((3, 4), 6))  # a whole write: the conversion is never made
    assert t._storage.lazy is None and torch.equal(t.cpu(), torch.full((3, 4), 6))
    t = x.to(TPU).to(torch.int64)
    assert t.tolist() == x.to(torch.int64).tolist()


def test_a_deferred_result_shares_no_memory_with_its_source():
    x = _values(torch.float32)
    src = x.to(TPU)
    t = src.to(torch.int32)
    assert _deferred(t) and t.data_ptr() != src.data_ptr()
    src.add_(100)  # the source written after the conversion: the result keeps its values
    assert torch.equal((t + 0).cpu(), x.to(torch.int32))
    assert torch.equal(t.cpu(), x.to(torch.int32))
    t = src.to(torch.int32)
    t.mul_(2)  # the result written: the source keeps its values
    assert torch.equal(src.cpu(), x + 100)
    assert torch.equal(t.cpu(), (x + 100).to(torch.int32) * 2)


def test_a_deferred_result_takes_the_fast_path(monkeypatch):
    calls = []
    original = cached_compute.CompiledCompute._call
    monkeypatch.setattr(
        cached_compute.CompiledCompute,
        "_call",
        lambda self, *a, **k: calls.append(self.func) or original(self, *a, **k),
    )
    x = torch.randn(4, 5)
    torch.add(x.to(TPU).half(), x.to(TPU).half())
    n = len(calls)
    got = torch.add(x.to(TPU).half(), x.to(TPU).half())
    assert len(calls) == n
    assert torch.equal(_bits(got), _bits(x.half() + x.half()))


def test_memory_allocated_counts_a_deferred_result_from_its_creation():
    # As a new tensor whose array is made on first read (Note [Storages filled on first
    # read]): counted from its creation, once when it is made.
    src = torch.randn(64, 64).to(TPU)  # 16 KiB
    src.add_(1)  # a made array
    before = torch.tpu.memory_allocated()
    t = src.to(torch.float64)
    assert _deferred(t)
    assert torch.tpu.memory_allocated() - before == 64 * 64 * 8
    assert t._storage.arr is not None  # made now
    assert torch.tpu.memory_allocated() - before == 64 * 64 * 8
    del t
    assert torch.tpu.memory_allocated() == before


def test_large_float8_complex_and_traced_conversions_are_made_at_the_call():
    big = torch.zeros(deferred_casts.MAX_BYTES // 2 + 1, device=TPU).to(torch.bfloat16)
    assert big._storage.lazy is None
    x = torch.randn(3, 4).to(TPU)
    assert x.to(torch.float8_e4m3fn)._storage.lazy is None
    assert x.to(torch.complex64)._storage.lazy is None

    @torchjax.jit
    def f(y, m):
        return y.to(torch.int32) + m

    mask = (x > 0).to(torch.int32)  # deferred, read inside the trace
    assert _deferred(mask)
    want = x.cpu().to(torch.int32) + (x.cpu() > 0).to(torch.int32)
    assert torch.equal(f(x, mask).cpu(), want)
    assert not isinstance(mask._storage.arr, jax.core.Tracer)  # made concrete
    assert torch.equal(mask.cpu(), (x.cpu() > 0).to(torch.int32))


def test_a_result_with_size_1_strides_is_made_at_the_call():
    # x[:, -1].to(dtype) keeps x's stride at the size-1 dimension (as CPU): deferred, it
    # would enter each consumer as a view keyed by that stride, which changes with x's
    # length. Made at the call, its value is at hand.
    x = torch.arange(20).reshape(1, 5, 4).to(TPU)
    last = x[:, -1]
    last.cpu()  # its value read, at hand for the conversion
    t = last.to(torch.float32)
    assert t.stride() == (20, 1) and t._cache_version == t._storage.version
    assert torch.equal(t.cpu(), torch.arange(16, 20).reshape(1, 4).float())


def test_a_source_placed_by_a_sharding_is_converted_at_the_call():
    # A random op reads its input's placement for its stream (Note [Compiled random
    # ops]): only single-device sources are deferred.
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    arr = jax.device_put(np.arange(6.0, dtype=np.float32), NamedSharding(mesh, PartitionSpec()))
    t = torchjax.from_jax(arr).to(torch.float64)
    assert t._storage.lazy is None
    assert torch.equal(t.cpu(), torch.arange(6.0, dtype=torch.float64))


def test_a_deferred_result_read_in_fused_eager():
    x = torch.randn(4, 4)
    t = x.to(TPU).to(torch.bfloat16)
    assert _deferred(t)
    with torchjax.fused():
        got = t * 2 + 1
    assert torch.equal(_bits(got), _bits(x.to(torch.bfloat16) * 2 + 1))


def test_a_growing_mask_converted_and_padded_is_one_program_per_length():
    # Eager generate's mask preparation (transformers' masking_utils): the 2-D mask, one
    # token longer each step, converted to bool and padded to the cache's length. The
    # conversion runs inside the padding's program: one program per length for both, where
    # each compiled its own (plus the cat that grows the mask, shared with the ids').
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    tmask = mask.to(TPU)
    ones = torch.ones(2, 1, dtype=torch.int64)
    tones = ones.to(TPU)
    compiles = []
    for _ in range(6):
        before = torchjax.stats()["compiles"]
        got = F.pad(tmask.to(torch.bool), (0, 12 - tmask.shape[1]))
        compiles.append(torchjax.stats()["compiles"] - before)
        assert torch.equal(got.cpu(), F.pad(mask.to(torch.bool), (0, 12 - mask.shape[1])))
        mask, tmask = torch.cat([mask, ones], -1), torch.cat([tmask, tones], -1)
    assert compiles == [1] * 6, compiles
