"""Strided read/write plans of Storage against NumPy's as_strided (no ops involved)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.interpreters import partial_eval

import torchjax
from torchjax._compat.jax import x64
from torchjax.tensor._storage import Storage, _plan, contiguous_strides

CASES = [
    # (storage shape, size, stride, offset)
    ((6,), (2, 3), (3, 1), 0),  # reshape
    ((2, 3), (3, 2), (1, 3), 0),  # transpose
    ((4, 5), (4, 2), (5, 2), 1),  # slice with step
    ((4, 5), (5,), (1,), 10),  # select a row
    ((4, 5), (4,), (5,), 2),  # select a column
    ((3, 4), (3, 4), (0, 1), 4),  # expand a row (read only)
    ((2, 3, 4), (4, 2, 3), (1, 12, 4), 0),  # permute
    ((2, 3, 4), (2, 2, 2), (12, 4, 2), 1),  # as_strided sub-block
    ((10,), (3, 2), (2, 3), 0),  # strides that no slice plan covers
    ((4, 4), (4,), (5,), 0),  # diagonal
    ((2, 8), (2, 4), (8, 1), 4),  # right half: window runs past the end
    ((1, 3), (3, 1), (1, 3), 0),  # size-1 dims
    ((5,), (0,), (1,), 0),  # empty
]


def _np_view(base, size, stride, offset):
    flat = base.reshape(-1)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], size, [s * item for s in stride])


@pytest.mark.parametrize("shape,size,stride,offset", CASES)
def test_read(shape, size, stride, offset):
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    with x64(True):
        st = Storage(jnp.asarray(base))
        got = np.asarray(st.read(size, stride, offset))
    np.testing.assert_array_equal(got, _np_view(base, size, stride, offset))


@pytest.mark.parametrize("shape,size,stride,offset", [c for c in CASES if 0 not in c[2]])
def test_write(shape, size, stride, offset):
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    value = -1 - np.arange(int(np.prod(size)), dtype=np.int64).reshape(size)
    expected = base.copy()
    _np_view(expected, size, stride, offset)[...] = value
    with x64(True):
        st = Storage(jnp.asarray(base))
        v0 = st.version
        st.write(size, stride, offset, jnp.asarray(value))
        got = np.asarray(st.arr)
    np.testing.assert_array_equal(got, expected)
    assert st.version == v0 + 1


def test_overlapping_write_raises():
    with x64(True):
        st = Storage(jnp.zeros(4, dtype=jnp.float32))
        with pytest.raises(RuntimeError, match="more than one element"):
            st.write((2, 2), (1, 1), 0, jnp.ones((2, 2), jnp.float32))


def test_plans_are_cached():
    assert _plan(12, (3, 4), (1, 3), 0) is _plan(12, (3, 4), (1, 3), 0)
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)


@pytest.mark.parametrize(
    "shape,size,stride",
    [((8, 5), (5,), (1,)), ((8, 5), (4,), (1,)), ((6, 4), (3, 2), (4, 1)), ((30,), (2, 2), (7, 3))],
)
def test_reads_at_many_offsets_share_one_executable(shape, size, stride):
    # Note [View offsets as arguments]: the offset is an argument of the read, so a
    # loop over positions does not compile one read per position.
    import torchjax

    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    span = sum((n - 1) * s for n, s in zip(size, stride)) + 1
    offsets = range(0, base.size - span + 1, 2)
    with x64(True):
        st = Storage(jnp.asarray(base))
        st.read(size, stride, offsets[0])
        before = torchjax.stats()["compiles"]
        for offset in offsets:
            got = np.asarray(st.read(size, stride, offset))
            np.testing.assert_array_equal(got, _np_view(base, size, stride, offset))
    assert len(offsets) > 4 and torchjax.stats()["compiles"] == before


@pytest.mark.parametrize(
    "shape,size,stride",
    [
        ((8, 5), (5,), (1,)),  # a row: contiguous
        ((6, 4), (3, 2), (4, 1)),  # a block: slice plan
        ((2, 8), (2, 4), (8, 1)),  # a half row: the window runs past the end
        ((30,), (2, 2), (7, 3)),  # no slice plan: gather
    ],
)
def test_writes_at_many_offsets_share_one_executable(shape, size, stride):
    # Note [View offsets as arguments]: a write takes its offset as an argument too, so
    # ``x[i] = row`` over every ``i`` compiles one write, each landing where NumPy's does.
    import torchjax

    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    span = sum((n - 1) * s for n, s in zip(size, stride)) + 1
    offsets = range(0, base.size - span + 1)
    with x64(True):
        st = Storage(jnp.asarray(base))
        # Two writes first: the storage's array from outside is not committed to a
        # device, the written one is (another executable for the first write).
        for offset in offsets[-2:]:
            st.write(size, stride, offset, jnp.zeros(size, jnp.int64))
        expected = np.asarray(st.arr).copy()
        values = [jnp.full(size, -1 - k, jnp.int64) for k in range(len(offsets))]
        before = torchjax.stats()["compiles"]
        for k, offset in enumerate(offsets):
            _np_view(expected, size, stride, offset)[...] = -1 - k
            st.write(size, stride, offset, values[k])
            np.testing.assert_array_equal(np.asarray(st.arr), expected)
    assert len(offsets) > 4 and torchjax.stats()["compiles"] == before


def test_setitem_in_a_loop_compiles_once_and_matches_cpu():
    import torchjax

    cpu = torch.zeros(50, 4, 3)
    src = torch.randn(50, 4, 3)
    x = cpu.to("tpu")
    s = src.to("tpu")
    x[:, 0, :] = s[:, 0, :]  # the first write and read of each layout compile
    cpu[:, 0, :] = src[:, 0, :]
    before = torchjax.stats()["compiles"]
    for i in range(1, 4):
        x[:, i, :] = s[:, i, :]
        cpu[:, i, :] = src[:, i, :]
    for i in range(50):
        x[i, 1:3, :] = s[49 - i, 1:3, :] * 2
        cpu[i, 1:3, :] = src[49 - i, 1:3, :] * 2
    torch.testing.assert_close(x.cpu(), cpu, rtol=0, atol=0)
    # The row loop compiles its read/write/mul layouts once, not once per row.
    assert torchjax.stats()["compiles"] - before <= 4


def test_window_past_the_end_reads_at_a_dynamic_offset():
    # A slice window that runs past the storage's end (the right half of the last row)
    # is read through the padded flat storage, at the offset given at run time.
    base = np.arange(16, dtype=np.int64).reshape(2, 8)
    plan = _plan(16, (2, 4), (8, 1), 4)
    assert plan.kind == "slice" and plan.dynamic and plan.impl.pad
    with x64(True):
        got = np.asarray(plan.read_array(jnp.asarray(base), 4))
    np.testing.assert_array_equal(got, base[:, 4:])


def test_in_place_op_through_overlapping_rows_refuses_and_leaves_the_tensor():
    # CPU applies it element by element (an order-dependent result); refused here.
    x = torch.arange(10.0, device="tpu")
    with pytest.raises(RuntimeError, match="share memory has no defined result"):
        x.as_strided((3, 4), (2, 1)).add_(100)
    assert x.tolist() == list(map(float, range(10)))


def test_view_reads_inside_a_trace_are_static_slices():
    # Note [View offsets inside a trace]: rotary's rotate_half of a transposed
    # projection (views of a traced storage read at offsets 0 and half) is slices, no
    # padded dynamic window, and matches CPU.
    import torchjax
    from tests._programs import equations

    def rotate(h):
        q = h.view(1, 8, 2, 16).transpose(1, 2)
        return torch.cat((-q[..., 8:], q[..., :8]), dim=-1) * 2

    h = torch.randn(8, 32)
    fn = torchjax.jit(rotate)
    got = fn(h.to("tpu"))
    torch.testing.assert_close(got.cpu(), rotate(h))
    names = [e.primitive.name for e in equations(fn)]
    assert "slice" in names
    assert "pad" not in names and "dynamic_slice" not in names, names


def test_writes_inside_a_trace_never_ask_a_tracer_for_its_placement(monkeypatch):
    # Asking a tracer for ``sharding`` or ``devices()`` raises an error whose message jax
    # builds by walking the whole trace so far: a write of a traced train step asking
    # made tracing quadratic in the program's length (Note [Writes keep the placement]).
    walks = []
    real = partial_eval.DynamicJaxprTracer._origin_msg

    def origin_msg(self):
        walks.append(1)
        return real(self)

    monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg", origin_msg)

    def step(state, x):
        state.mul_(0.5).add_(x)  # whole writes
        state[1:3].add_(x[1:3])  # a strided one
        y = x.double()  # a float64 tensor's metadata (the emulated float64 warning)
        state.index_copy_(0, torch.tensor([0]).to(state.device), y[:1].float())
        return state.sum()

    state, x = torch.ones(4).to("tpu"), torch.arange(4.0).to("tpu")
    want_state, want_x = torch.ones(4), torch.arange(4.0)
    got = torchjax.jit(step)(state, x)
    want = step(want_state, want_x)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(state.cpu(), want_state, rtol=0, atol=0)
    assert walks == []
