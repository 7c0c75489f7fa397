"""The arrays of storages made on first read (Note [Storages filled on first read] in
torchjax/tensor/_storage.py), outside a trace and inside one."""

from __future__ import annotations

import contextlib
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from torchjax import _budget
from torchjax._compat.jax import put_host, x64

_FILLS: dict = {}

# Note [Fills of storages made inside a trace]
# A storage made by a factory holds no array until it is first read. Read first inside
# a trace, its fill used to be evaluated to a concrete array. That is right for a
# storage made before the trace, which outlives it. But a storage made inside the
# trace then became a constant of the program, and XLA keeps a program's constants for
# the executable's life. Such storages are AdamW's moments in a first step, the zeros
# an embedding's or a slice's backward scatters into, and a model's masks. The first
# training step of a 1.1B Llama captured 5.57 GB of them and peaked at 12.2 GiB on a
# 15.7 GiB chip (pure JAX: 6.5 GiB), so a batch JAX trains on ran out of memory.
# Now a storage made within ``fills_traced`` (around a compiled function's trace and a
# compiled backward's) and first read there gets its fill as a broadcast inside the
# program, which XLA fuses into its readers and never keeps. When the block ends, such
# a storage that nothing wrote is unfilled again: its fill is still all it holds, and
# no tracer outlives the trace. One the trace wrote holds a traced value like every
# written storage, and the compiled function makes it an output when its state holds
# it (``traced_fill`` tells the two apart).
_LOCAL = threading.local()  # .block: (epoch, {id: (storage, traced array, lazy)})


@contextlib.contextmanager
def fills_traced(epoch: int):
    """Within the block, storages born at ``epoch`` or later (``Storage.born``) that are
    first read in it get traced fills (Note [Fills of storages made inside a trace]).
    Yields {id(storage): (storage, traced fill, fill)} of those storages."""
    previous = getattr(_LOCAL, "block", None)
    made: dict = {}
    _LOCAL.block = (epoch, made)
    try:
        yield made
    finally:
        _LOCAL.block = previous
        _unfill(made)


def fill_of(storage):
    """The traced fill of ``storage`` if a ``fills_traced`` block of this thread covers
    it and a trace is running; else None (the caller makes a concrete fill)."""
    block = getattr(_LOCAL, "block", None)
    if block is None or storage.born < block[0]:
        return None
    lazy = storage.lazy
    with x64(True):
        arr = jnp.full(storage.shape, lazy[0], lazy[1])
    if not isinstance(arr, jax.core.Tracer):  # evaluated eagerly (compile-time eval)
        return None
    block[1][id(storage)] = (storage, arr, lazy)
    return arr


def unread_fill(t):
    """The value of every element of tpu tensor ``t`` while its storage, exactly ``t``,
    still holds only its fill (nothing read it yet); else None."""
    storage = t._storage
    lazy = getattr(storage, "lazy", None)
    if lazy.__class__ is not list or not storage.covers(t._size, t._stride, t._offset):
        return None
    return lazy[0]


def traced_fill(storage) -> bool:
    """Whether ``storage`` holds nothing but the traced fill this thread's block gave it."""
    block = getattr(_LOCAL, "block", None)
    entry = None if block is None else block[1].get(id(storage))
    return entry is not None and _held(storage) is entry[1]


def _slot(storage):
    """The ``arr`` slot of ``storage``'s class (read without filling a lazy storage; a
    trace may have swapped the class for a subclass of the same layout)."""
    return next(k.__dict__["arr"] for k in type(storage).__mro__ if "arr" in k.__dict__)


def _held(storage):
    try:
        return _slot(storage).__get__(storage)
    except AttributeError:
        return None


def _unfill(made: dict) -> None:
    for storage, arr, lazy in made.values():
        if _held(storage) is not arr:
            continue  # written in the trace: the compiled function's business
        refill(storage, lazy)


def refill(storage, lazy) -> None:
    """Make ``storage`` hold nothing but its fill ``lazy`` again, made on first read."""
    _slot(storage).__delete__(storage)
    storage.lazy = lazy
    storage.interpretations = None
    storage.version += 1  # no tensor's read cache keeps the traced value


HOST_FILL_BYTES = 1 << 20


def _filled(shape, dtype, fill, device) -> jax.Array:
    # Under a mesh (torchjax.mesh, jax.set_mesh) the fill executable places the array
    # as every other op's output is placed there; host values would sit on one device.
    if (
        math.prod(shape) * dtype.itemsize <= HOST_FILL_BYTES
        and jax.sharding.get_abstract_mesh().empty
    ):
        with x64(True), jax.ensure_compile_time_eval():
            return host_onto(np.full(shape, fill, dtype), device)
    key = (shape, dtype, type(fill), fill)
    run = _budget.cached(_FILLS, key, lambda: jax.jit(lambda: jnp.full(shape, fill, dtype)))
    with x64(True):
        arr = run()
        if isinstance(arr, jax.core.Tracer):
            # First read inside a trace (torchjax.jit reading a tensor made outside it):
            # the storage outlives the trace, so its array must be concrete. (Evaluated
            # this way outside a trace, the fill would take twice the memory.)
            with jax.ensure_compile_time_eval():
                arr = run()
        return _on_device(arr, device)


# Note [Uncommitted arrays on tpu:0]
# jax keys a jitted function's executables on how its arguments are placed as well as on
# their shapes: an argument committed to a device (``jax.device_put(x, device)``) and
# one that is not (made on the default device with no device named) lower to two
# programs, each compiled. Arrays of tpu:0 are uncommitted, as an executable's output
# from no committed input is (so they may also join a computation over a mesh's
# devices); arrays of tpu:N, N > 0, are committed to that device. Everything that puts
# host data on tpu follows that rule through ``host_onto``: factories, ``x.to("tpu")``
# and the checkpoint loaders. The loaders committed tpu:0 weights, so a model's outputs
# were committed and a loop mixing them with tensors made on tpu compiled each program
# twice: eager ``generate`` of a model from ``from_pretrained(device_map="tpu")``
# compiled its ``cat`` of the growing ids and its reads of the last token once per
# placement, four programs per token where two do.
def host_onto(host: np.ndarray, device, *, outside_mesh: bool = False) -> jax.Array:
    """NumPy ``host`` on jax ``device`` as a tpu tensor's array (Note [Uncommitted arrays
    on tpu:0]): uncommitted on tpu:0, committed to any other local device.
    ``outside_mesh``: as ``put_host``'s."""
    if device == jax.devices()[0] or not _local(device):
        return put_host(host, outside_mesh=outside_mesh)
    return put_host(host, device, outside_mesh=outside_mesh)


def _on_device(arr, device):
    """``arr`` on ``device`` (a jax device), if it is a concrete array elsewhere. With
    several processes (jax.distributed) tpu:N names a global device that may belong to
    another process: an array stays on this process's device then, as an op's output
    does."""
    if isinstance(arr, jax.Array) and not isinstance(arr, jax.core.Tracer):
        devices = arr.devices()
        if len(devices) == 1 and device not in devices and _local(device):
            return jax.device_put(arr, device)
    return arr


def _local(device) -> bool:
    return device.process_index == jax.process_index()
