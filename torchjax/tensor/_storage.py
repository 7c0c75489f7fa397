"""Storage: the mutable home of a jax array that several tpu tensors alias.

Note [Aliasing through views]
jax arrays are immutable, but PyTorch views alias memory: ``x[0].add_(1)`` changes ``x``.
torchjax mirrors PyTorch's storage model. A ``Storage`` holds one jax array ``arr`` whose
row-major flattening is the storage's flat buffer. Every tpu tensor is (storage, size,
stride, storage_offset) exactly as PyTorch reports them, so view metadata is PyTorch's own.

- Reading a tensor that covers its whole storage contiguously is ``storage.arr``.
- Reading any other view takes the elements at ``offset + sum(i_k * stride_k)`` from the
  flat buffer (a strided plan: slices and a transpose where the strides allow, a gather
  otherwise). Tensors cache what they read, tagged with ``storage.version``.
- Writing (any in-place op, ``copy_``, ``out=``) scatters the new values into the flat
  buffer through the same plan, replaces ``storage.arr`` and bumps ``storage.version``,
  so every live view re-reads on next use.
- A view of another dtype (``x.real``, ``view(dtype)``, ``view_as_real``) or with torch's
  conj/neg bit reads and writes the same root storage through an ``Interpretation``: see
  Note [Views across dtypes] in torchjax/tensor/_reinterpret.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from torchjax._compat.jax import x64
from torchjax.tensor._fills import (
    _filled,
    _on_device,
    fill_of,
    fills_traced,
)
from torchjax.tensor._view_plans import (  # noqa: F401  (re-exported: the storage's names)
    _plan,
    contiguous_strides,
    layout_plan,
    read_strides,
)

# Note [Writes that escape a trace]
# A compiled function's state is what its walk finds (Note [State of a jitted function]
# in torchjax/compile/_state.py); those storages are bound to tracers while it traces. A
# tensor the walk cannot see (held by an object with ``__slots__``, a global only a
# callee names) is read as a constant, and an in-place write to it stored the trace's
# tracer in the user's own storage: the write was lost and every later read of the
# tensor failed. While a ``torchjax.jit`` trace runs (``escapes_watched``), a write into
# a plain storage made before the trace (``born``: the epoch it was made in) is noted
# with what the storage held; the trace puts those back and refuses the function with an
# error naming the tensor and what to do, instead of corrupting it. A write of a concrete
# value counts as well (a host copy, or a value made from constants and so evaluated when
# traced: Note [Values made from constants inside a trace] in
# torchjax/ops/executables.py): it would happen once, when traced, and never again when
# the program runs.
_EPOCH = [0]  # bumped when a trace starts watching
_WATCHERS = [0]  # traces watching, any thread
_ESCAPES = threading.local()


@contextlib.contextmanager
def escapes_watched():
    """Within the block, this thread's traced writes into storages made before it are
    collected (Note [Writes that escape a trace]); yields the list of (storage, what it
    held) entries, to put back with ``restore_escapes``."""
    # (found, epoch) per thread; a watch inside another (a trace within a trace) gives
    # the outer one back, its own epoch with it.
    previous = getattr(_ESCAPES, "watch", None)
    _EPOCH[0] += 1
    found = []
    _ESCAPES.watch = (found, _EPOCH[0])
    _WATCHERS[0] += 1
    try:
        yield found
    finally:
        _WATCHERS[0] -= 1
        _ESCAPES.watch = previous


def _note_escape(storage, value) -> None:
    watch = getattr(_ESCAPES, "watch", None)
    if watch is None:
        return
    found, epoch = watch
    if storage.born >= epoch:
        return
    if any(s is storage for s, *_ in found):
        return
    try:
        arr = _ARR.__get__(storage)
    except AttributeError:
        arr = None
    if isinstance(arr, jax.core.Tracer):
        return
    found.append((storage, arr, storage.lazy))


def traced_fills():
    """A block within which storages made in it and first read in it get traced fills
    (Note [Fills of storages made inside a trace] in torchjax/tensor/_fills.py)."""
    _EPOCH[0] += 1
    return fills_traced(_EPOCH[0])


def made_before_watch(storage) -> bool:
    """Whether ``storage`` was made before this thread's watching trace began (False
    outside a watch)."""
    watch = getattr(_ESCAPES, "watch", None)
    return watch is not None and storage.born < watch[1]


def restore_escapes(found) -> None:
    """Give each storage ``escapes_watched`` collected what it held before the trace."""
    for storage, arr, lazy in found:
        if arr is None:
            try:
                _ARR.__delete__(storage)
            except AttributeError:
                pass
        else:
            _ARR.__set__(storage, arr)
        storage.lazy = lazy
        storage.version += 1  # no tensor's read cache keeps the traced value


class Storage:
    """A jax array that tensors alias; ``version`` counts writes."""

    # interpretations: this storage read as other dtypes / conj / neg, created on demand
    # (Note [Views across dtypes] in torchjax/tensor/_reinterpret.py).
    # lazy: [fill, dtype, jax device] while the array is not made yet, else None
    # (Note [Storages filled on first read]); or, in fused eager mode, the pending value
    # of a recorded op (Note [Fused eager] in torchjax/ops/fused.py); or a conversion
    # not made yet (Note [Conversions read by their consumers] in
    # torchjax/ops/deferred_casts.py). A lazy value that is not a list has ``resolve()``.
    # torch_storage: the tpu UntypedStorage standing for this storage once asked for
    # (Note [torch storages of tpu tensors] in torchjax/tensor/_addresses.py); unset before.
    __slots__ = (
        "arr",
        "version",
        "numel",
        "shape",
        "interpretations",
        "lazy",
        "torch_storage",
        "born",
        "__weakref__",
    )

    def __init__(self, arr: jax.Array, shape=None, numel=None):
        # shape/numel: precomputed by callers that have them (wrap), to save the work.
        self.arr = arr
        self.version = 0
        self.born = _EPOCH[0]
        self.shape = tuple(arr.shape) if shape is None else shape
        self.numel = math.prod(self.shape) if numel is None else numel
        self.interpretations = None
        self.lazy = None

    @classmethod
    def made_later(cls, shape, lazy, numel=None) -> Storage:
        """A storage of ``shape`` whose array ``lazy`` makes when first read: a fill
        (``filled``), a recorded value (Note [Fused eager]), a value in another memory
        order (Note [Storages in memory order, made on first read]) or a conversion
        (Note [Conversions read by their consumers]). ``numel``: the shape's element
        count, when the caller has it."""
        self = cls.__new__(cls)
        self.version = 0
        self.born = _EPOCH[0]
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape) if numel is None else numel
        self.interpretations = None
        self.lazy = lazy
        return self

    @classmethod
    def filled(cls, shape, dtype, device, fill=0) -> Storage:
        """A storage of ``shape`` and ``dtype`` (jax's) on ``device``, every element
        ``fill``, whose array is made when first read."""
        self = cls.made_later(shape, [fill, dtype, device])
        _UNFILLED.add(self)
        return self

    def __getattr__(self, name):
        # Only reached for an unset slot: ``arr`` of a storage not filled yet.
        lazy = self.lazy if name == "arr" else None
        if lazy is None:
            raise AttributeError(f"'Storage' object has no attribute {name!r}")
        if lazy.__class__ is not list:  # a pending value: its segment runs now
            arr = lazy.resolve()
            self.arr = arr
            self.lazy = None
            return arr
        fill, dtype, device = lazy
        arr = fill_of(self)
        if arr is None:
            arr = _filled(self.shape, dtype, fill, device)
        self.arr = arr
        self.lazy = None
        return arr

    def set_fill(self, value) -> bool:
        """``fill_(value)`` of the whole storage without making an array, if it can."""
        lazy = self.lazy
        if lazy.__class__ is not list or type(value) not in (bool, int, float):
            return False
        if type(value) is not bool and value not in (0, 1):
            return False
        lazy[0] = value
        self.version += 1
        return True

    def grow(self, numel: int) -> None:
        """Extend the storage in place to ``numel`` elements, zeros after the old ones
        (``resize_`` past its end: every tensor sharing the storage sees the new one)."""
        lazy = self.lazy
        if lazy.__class__ is list and (self.numel == 0 or _is_plus_zero(lazy[0])):
            # Zeros grown with zeros stay unmade (Note [Storages filled on first read]):
            # an ``out=`` resized from empty (``torch.arange``, ``cat(out=)``) is then
            # written whole, and no zeros are ever computed.
            lazy[0] = 0
            self._reshape_unfilled(numel)
            return
        if lazy is None and self.numel == 0:
            arr = self.arr
            devices = () if isinstance(arr, jax.core.Tracer) else arr.devices()
            if len(devices) == 1 and not isinstance(arr.sharding, NamedSharding):
                del self.arr
                self.lazy = [0, arr.dtype, next(iter(devices))]
                _UNFILLED.add(self)
                self._reshape_unfilled(numel)
                return
        flat = self.arr.reshape(-1)
        self.arr = jnp.concatenate([flat, jnp.zeros((numel - self.numel,), flat.dtype)])
        self._reshape_unfilled(numel)

    def _reshape_unfilled(self, numel: int) -> None:
        self.shape, self.numel = (numel,), numel
        self.interpretations = None
        self.version += 1

    def covers(self, size, stride, offset) -> bool:
        """True when (size, stride, offset) is the whole storage in its own shape."""
        return offset == 0 and size == self.shape

    def read(self, size, stride, offset) -> jax.Array:
        if self.covers(size, stride, offset) and stride == contiguous_strides(size):
            return self.arr
        plan = _plan(self.numel, size, stride, offset)
        arr = self.arr
        return plan.read_array(arr, offset if plan.dynamic and not _traced(arr) else None)

    def write(self, size, stride, offset, value: jax.Array) -> None:
        """Store ``value`` (shape ``size``, storage dtype) at the strided view."""
        if _WATCHERS[0] and self.__class__ is Storage:
            _note_escape(self, value)
        lazy = self.lazy
        if lazy is not None and lazy.__class__ is not list:
            # A pending value (Note [Fused eager]): a whole write needs none of it.
            if self.covers(size, stride, offset) and stride == contiguous_strides(size):
                self.arr = value
                self.lazy = None
                self.version += 1
                return
            self.__getattr__("arr")  # a partial write: its segment runs first
            lazy = None
        if (
            lazy is not None
            and self.covers(size, stride, offset)
            and stride == contiguous_strides(size)
        ):
            if value.dtype != lazy[1]:
                raise AssertionError(f"storage write dtype {value.dtype} != {lazy[1]}")
            self.arr = _on_device(value, lazy[2])
            self.lazy = None
            self.version += 1
            return
        if value.dtype != self.arr.dtype:
            raise AssertionError(f"storage write dtype {value.dtype} != {self.arr.dtype}")
        if self.covers(size, stride, offset) and stride == contiguous_strides(size):
            self.arr = _keep_placement(value, self.arr)
        else:
            plan = _plan(self.numel, size, stride, offset)
            dynamic = plan.dynamic and not _traced(self.arr)
            new = plan.write_array(self.arr, value, offset if dynamic else None)
            self.arr = _keep_placement(new, self.arr)
        self.version += 1

    def __deepcopy__(self, memo) -> Storage:
        # A physical copy, not the same (immutable) jax array: a compiled step may donate
        # the original's buffer, and a copy the user took must survive that. x64 on, as
        # inside dispatch: jnp would otherwise narrow an int64/float64 storage.
        with x64(True):
            arr = jnp.copy(self.arr)
        return Storage(arr, self.shape, self.numel)

    def replace(self, arr: jax.Array) -> None:
        """Swap in a new array of the same shape and dtype (a whole-storage write)."""
        if _WATCHERS[0] and self.__class__ is Storage:
            _note_escape(self, arr)
        lazy = self.lazy
        if lazy.__class__ is not list and lazy is not None:  # pending (Note [Fused eager])
            self.arr = arr
            self.lazy = None
        elif lazy is not None:
            self.arr = _on_device(arr, lazy[2])
            self.lazy = None
        else:
            self.arr = _keep_placement(arr, self.arr)
        self.version += 1


class StandIn(Storage):
    """Another array holding the elements of ``root`` (a Storage) while one op runs:
    what the op writes or reads through it concerns ``root``'s memory, so checks that
    compare memory (overlap, addresses) see ``root`` (Note [Stopped gradients in
    compiled programs] in torchjax/compile/_stop_gradient.py)."""

    __slots__ = ("root",)

    def __init__(self, arr: jax.Array, root: Storage):
        super().__init__(arr, root.shape, root.numel)
        self.root = root


# Note [Storages filled on first read]
# ``torch.empty(n, device="tpu")``, ``x.to("tpu")`` and every factory start from a new
# storage. jax arrays are immutable, so a storage made as an array of zeros and then
# written whole (the copy of ``.to("tpu")``, the fill of ``torch.ones``) held two full
# arrays at once: a 1 GiB ``torch.ones`` peaked at 2 GiB, ``.to("tpu")`` above 2 GiB
# (on XLA:CPU device memory is host memory). A storage made by ``Storage.filled`` holds
# no array until one is asked for (``storage.arr``: the slot is unset, ``__getattr__``
# makes it, once; ``lazy`` holds the fill, dtype and device meanwhile). The class stays
# ``Storage`` (torchjax.jit swaps a storage's class to one of the same layout):
# - a write covering the whole storage replaces it, and no fill is ever made;
# - ``fill_``/``zero_`` of the whole storage with 0, 1 or a bool (values every dtype
#   holds exactly, so torch's overflow checks have nothing to say) only change ``fill``;
# - anything else (a read, a partial write, a view of another dtype) makes the array:
#   ``jnp.full(shape, fill, dtype)`` as one executable per (shape, dtype, fill), an entry
#   of the cache budget (Note [Executable cache budget] in torchjax/_budget.py).
# Every factory uses it. A small storage (up to _fills.HOST_FILL_BYTES) read before any write
# gets its array as host values put on the device instead: a transfer compiles nothing,
# where an on-device fill would compile once per new shape (30-50 ms, most of a model's
# time to first result; Note [Zeros for new tensors] in torchjax/device/_factory.py).
# Most small factories are written whole at once (``torch.randn`` is ``empty`` then
# ``normal_``, ``x.to("tpu")`` is ``empty_strided`` then ``copy_``, ``torch.full`` a
# fill), so they make no array of zeros and transfer nothing. Seen from outside:
# ``torch.tpu.memory_allocated()`` counts a tensor from its creation, as CUDA's does: the
# arrays that exist plus the bytes of storages whose array is not made yet
# (``unfilled_bytes``, from a weak set of the storages ``filled`` made).
_UNFILLED: weakref.WeakSet = weakref.WeakSet()


def _is_plus_zero(fill) -> bool:
    return fill == 0 and math.copysign(1.0, fill) > 0


def count_unmade(storage) -> None:
    """Count ``storage``, made by ``made_later`` with a lazy value that has
    ``nbytes_on(device)`` (a deferred conversion: Note [Conversions read by their
    consumers] in torchjax/ops/deferred_casts.py), in ``unfilled_bytes`` until its array
    is made, as ``filled`` storages are."""
    _UNFILLED.add(storage)


def unfilled_bytes(device) -> int:
    """Bytes of live storages on jax ``device`` whose array is not made yet."""
    total = 0
    for s in list(_UNFILLED):
        lazy = s.lazy
        if lazy.__class__ is list:
            if lazy[2] == device:
                total += s.numel * lazy[1].itemsize
        elif lazy is not None:
            # A deferred conversion counts; fused eager's pending value (in a storage
            # filled once) does not, as before.
            nbytes_on = getattr(lazy, "nbytes_on", None)
            if nbytes_on is not None:
                total += nbytes_on(device)
    return total


# Note [Writes keep the placement]
# A write changes a storage's values, never where they live, as an in-place op on a CUDA
# tensor never moves it. For a storage sharded over a mesh (torchjax/sharding) the new
# array comes from a computation whose output sharding XLA chose: a strided write goes
# through the flat buffer (reshape(-1), scatter, reshape), after which XLA typically
# replicates it, and a KV-cache slice assignment or an optimizer's in-place update would
# silently gather a sharded tensor onto every device. So a write into a NamedSharding
# storage puts the result back on that sharding. Tracers (torchjax.jit) have no
# ``sharding`` attribute: layouts inside a program are XLA's business. They are checked
# for first: asking a tracer for its ``sharding`` raises an AttributeError whose message
# jax builds by walking the whole trace so far for the value's origin, and with every
# write of a traced train step asking, a 16-layer Llama's trace spent most of its time
# there (quadratic in the program's length).
def _traced(arr) -> bool:
    """Whether ``arr`` is a value of a trace (Note [View offsets inside a trace])."""
    return isinstance(arr, jax.core.Tracer)


def _keep_placement(new: jax.Array, old: jax.Array) -> jax.Array:
    if isinstance(old, jax.core.Tracer) or isinstance(new, jax.core.Tracer):
        return new
    sharding = getattr(old, "sharding", None)
    if type(sharding) is NamedSharding and getattr(new, "sharding", sharding) != sharding:
        return jax.device_put(new, sharding)
    return new


_ARR = Storage.__dict__["arr"]  # the slot itself, read without filling a lazy storage
