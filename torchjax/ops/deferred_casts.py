"""Conversions of small tensors, computed inside the programs of the ops that read them.

Note [Conversions read by their consumers]
``x.to(dtype)`` in eager was one XLA program of its own, per shape: a conversion of a
tensor that grows every step is a new program every step. Eager ``generate`` of a
left-padded batch converts its 2-D attention mask, one token longer each step, to bool
and pads it to the static cache's length (transformers' mask preparation): two new
programs per token, where the padding alone, with the conversion inside it, is one.

So a conversion of a small tensor (source and result at most ``MAX_BYTES``) on its own
device, in plain eager, computes nothing when it is called: the result's storage holds
the source array and the target dtype (``Cast``, a lazy value as Note [Storages filled
on first read] describes, counted by ``torch.tpu.memory_allocated()`` from its creation
as those are). A compiled op that reads the result whole may take the source as its
argument and convert it inside its own executable (template entry ``Astype``; the fast
path keys it by size and source dtype), as a lazy view's read joins its consumer (Note
[Lazy views] in torchjax/ops/views.py). Anything else that needs the array (a view of
the result, a partial write, a host read, an op run op by op, a trace, a consumer that
refuses it) makes it once, with the conversion's own ``astype``, and the storage holds
it from then on; a whole write replaces it unmade.

Which consumers may: those whose executable, traced with the conversion inside, is
elementwise by fused eager's rule (``fusion_cuts.elementwise``, Note [Fusion keeps
eager's numbers] in torchjax/ops/fusion_cuts.py), decided per key and input signature
before the executable is entered (``Consumers``; the trace serves the call). A
reduction or a dot that XLA:CPU fuses with a conversion computes differently: a
bfloat16 softmax of a float32 tensor of (128, 64) converted inside gave values up to
0.49 away from the conversion made first (which are CPU's), its sum over a dimension
the float32 sum rounded once (the conversion's rounding lost inside a YNNPACK fusion,
excess precision off or not). Such a key is refused: its calls make their conversions
first, as before. Elementwise chains keep each op's rounding (excess precision off:
Note [Compiled lowerings]); a convert is not among the producers XLA rewrites across
(``fusion_cuts``'s ``_REWRITABLE``). A random op makes its conversions first, always:
its draw is not elementwise, so a conversion read inside would only be refused and the
call made again. (Made again, it draws from the counter value the first call reserved,
Note [Random ops compiled or not] in torchjax/ops/_seeded.py; reserving a second one
would move this draw and every later one.)

Nothing a user can see changes:
- values: as the conversion made at the call, bit for bit (tests/ops/test_deferred_casts.py
  compares every pair of plain dtypes on special values (NaN, infinities, subnormals,
  values out of the target's range) read by consumers of each kind, at XLA's defaults).
  The source array is immutable; a donated state buffer that a ``Cast`` holds is copied
  first (Note [Donation never takes the user's copy]);
- dtype, shape, strides, device: a new contiguous tensor of the target dtype, as
  before. A conversion whose result reports other strides at size-1 dimensions
  (``x[:, -1].float()`` keeps ``x``'s stride there) is made at the call: read through
  those strides it would enter its consumers as a view keyed by its layout, a new key
  whenever the source's length changes;
- aliasing: the result shares no memory with the source; a later write to either does
  not reach the other (the source's write makes a new array, the ``Cast`` keeps the old);
- errors: a conversion raises nothing; a consumer's trace raises what it raised.

Not deferred: a large tensor (read by many ops, as a model's weights after
``model.to(torch.bfloat16)``, it would be converted again inside each of them and keep
its source's memory alive); anything under a trace or a mesh; a source spread over
several devices or placed by a sharding (a random op reads its input's placement for its
stream: Note [Compiled random ops] in torchjax/ops/_seeded.py); conversions while fused
eager records (Note [Fused eager] records them itself); float8 and complex conversions
(their saturation and warnings); and a bool made a float, which converts behind a
barrier (Note [A converted bool is not a select]) that no elementwise consumer admits.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from torchjax._compat.jax import plain_eager, x64_enter, x64_exit
from torchjax.ops import fused, promotion
from torchjax.ops.fusion_cuts import elementwise
from torchjax.ops.promotion import astype
from torchjax.ops.templates import has_cast
from torchjax.tensor._shadows import HostValues
from torchjax.tensor._storage import Storage, contiguous_strides, count_unmade
from torchjax.tensor._tensor import make

# The largest source or result, in bytes, whose conversion is deferred.
MAX_BYTES = 1 << 16

# bool, the integers and the floats but float8: the dtypes whose conversions are deferred
_PLAIN = frozenset(
    np.dtype(d)
    for d in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
    )
)  # fmt: skip
_FLOATS = frozenset(np.dtype(d) for d in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))


class Cast:
    """The lazy value of a storage: ``src`` (a jax array) converted to ``dtype``."""

    __slots__ = ("src", "dtype")

    def __init__(self, src, dtype):
        self.src, self.dtype = src, dtype

    def resolve(self):
        token = x64_enter()  # an int64/float64 value stays 64-bit
        try:
            # Concrete even when first read inside a trace: the storage outlives it.
            with jax.ensure_compile_time_eval():
                return astype(self.src, self.dtype)
        finally:
            x64_exit(token)

    def nbytes_on(self, device) -> int:
        """Bytes the made array will take on jax ``device`` (``unfilled_bytes``)."""
        if device not in self.src.sharding.device_set:
            return 0
        return self.src.size * np.dtype(self.dtype).itemsize


def defer(t, jdt, dtype, stride):
    """A new tpu tensor of ``t``'s values as ``jdt`` (torch ``dtype``) on its device,
    contiguous, its conversion deferred (Note [Conversions read by their consumers]);
    None where it is computed now (among others: ``stride``, the strides the result
    reports, not contiguous)."""
    if fused.ACTIVE[0] or not plain_eager():
        return None
    storage, size = t._storage, t._size
    if stride != contiguous_strides(size):
        return None
    if storage.lazy.__class__ is HostValues:
        storage.arr  # noqa: B018 - put now (Note [Host values put on the device when first read])
    if t._cache_version == storage.version:
        src = t._cache
    elif (
        storage.lazy is None
        and storage.covers(size, t._stride, t._offset)
        and t._stride == contiguous_strides(size)
    ):
        src = storage.arr
    else:
        return None
    if (
        not isinstance(src, jax.Array)
        or isinstance(src, jax.core.Tracer)
        or src.sharding.__class__ is not SingleDeviceSharding
        or src.size * max(src.dtype.itemsize, np.dtype(jdt).itemsize) > MAX_BYTES
        or src.dtype not in _PLAIN
        or np.dtype(jdt) not in _PLAIN
        or src.dtype == jdt  # no conversion: the result would be the source array
        # A bool made a number converts behind a barrier (Note [A converted bool is not
        # a select]), which no elementwise consumer admits.
        or (src.dtype == np.bool_ and np.dtype(jdt) in _FLOATS)
    ):
        return None
    result = Storage.made_later(size, Cast(src, jdt))
    count_unmade(result)
    return make(result, size, stride, 0, dtype, t._device_index)


def read_whole(t) -> bool:
    """Whether tpu tensor ``t``, whose storage holds a deferred conversion, may enter a
    consumer's executable as that conversion's source: the whole storage, in plain
    eager (under a trace it is made: a concrete value, as before)."""
    size = t._size
    return (
        t._storage.covers(size, t._stride, t._offset)
        and t._stride == contiguous_strides(size)
        and plain_eager()
    )


class Consumers:
    """Which keys of one overload read a deferred conversion inside their executables:
    those whose traced program is elementwise (Note [Conversions read by their
    consumers]); ``refused`` holds the others, whose calls make their conversions first.
    ``kind``, ``build_run(tmpl, kwtmpl, dts)``: the overload's promotion and executable
    builder; ``errors``: the trace errors that run a call op by op."""

    __slots__ = ("kind", "build_run", "errors", "refused")

    def __init__(self, kind, build_run, errors):
        self.kind, self.build_run, self.errors = kind, build_run, errors
        self.refused: set = set()

    def build(self, key, tmpl, kwtmpl, psig, dyn, scalars, floats=None):
        """For a new executable of ``key`` on ``dyn``: None where its template reads no
        deferred conversion; else the executable, traced here (its call reuses the
        trace) and elementwise, or False (refused). ``floats``: indices of the Python
        floats passed as float64 values."""
        if key in self.refused:
            return False
        if not any(has_cast(e) for e in tmpl) and not any(has_cast(e) for _, e in kwtmpl):
            return None
        dts = promotion.promoted_by_key(self.kind, psig) if self.kind is not None else None
        run = self.build_run(tmpl, kwtmpl, dts)
        # The arguments as the call passes them: Python numbers as 0-d arrays of the
        # computation dtype, recorded values (Note [Fused eager]) by their shapes.
        probe = list(dyn)
        for j in scalars:
            probe[j] = promotion.scalar_argument(probe[j], dts[0])
        for j in floats or ():
            probe[j] = np.float64(probe[j])
        probe = [
            jax.ShapeDtypeStruct(d.shape, d.dtype, weak_type=d.weak_type)
            if d.__class__ is fused.Pending
            else d
            for d in probe
        ]
        try:
            admitted = elementwise(run.trace(*probe).jaxpr.jaxpr)
        except self.errors:
            admitted = False  # the call, its conversions made first, meets the error
        if admitted:
            return run
        self.refused.add(key)
        return False
