"""Copies, device transfers and metadata ops: the handlers that see tensors, not arrays.

``x.to("tpu")`` arrives as ``empty_strided`` (torchjax/device/_factory.py) and then
``copy_`` here; ``.cpu()`` and ``.to(dtype)`` arrive as ``_to_copy``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import host_copy, trace_state_clean, x64
from torchjax._compat.torch import awaits_legacy_bytes, call_composite_explicit, untyped_storage_of
from torchjax._compat.torch_dynamo import active_fake_mode, active_proxy_mode
from torchjax.device import _checks, _stats
from torchjax.device._module import jax_device
from torchjax.device._serialization import defer_until_loaded, loading, storage_for
from torchjax.ops import deferred_casts, fused, fused_reads, writeback
from torchjax.ops.functional import cpu_to_jax
from torchjax.ops.promotion import astype
from torchjax.ops.registry import handler, lowering
from torchjax.ops.writeback import write_into
from torchjax.tensor import _fake, _shadows, dtypes
from torchjax.tensor._addresses import root_of, storage_view
from torchjax.tensor._host_storage import host_view, is_host_backed
from torchjax.tensor._memory_format import (
    in_row_major_order,
    is_dense_permutation,
    laid_out,
    memory_order,
    restrided,
    result_strides,
)
from torchjax.tensor._shadows import HostValues
from torchjax.tensor._storage import Storage, contiguous_strides
from torchjax.tensor._tensor import JaxTensor, make, view_of, wrap

aten = torch.ops.aten


def to_host(arr: jax.Array) -> np.ndarray:
    """A NumPy copy of ``arr`` (blocks until it is computed). An array sharded over
    devices of several processes (``jax.distributed``) is all-gathered first: then every
    process must make the same call, as for any collective. A synchronisation point:
    pending device checks raise first (Note [Device-side checks])."""
    _checks.raise_pending()
    _stats.count_host_read()
    if not arr.is_fully_addressable and not arr.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    return host_copy(arr)  # no host copy left cached on ``arr``


def to_cpu(t: JaxTensor) -> torch.Tensor:
    """A CPU tensor holding a copy of ``t``'s data (blocks until it is computed)."""
    known = _shadows.lookup(t)  # Note [Host values of tensors made from host data]
    if known is not None:
        _checks.raise_pending()
        return known
    arr = t._value()
    if arr.ndim > 64:  # NumPy's limit, not torch's: read flat, shaped on the host
        return dtypes.numpy_to_cpu_tensor(to_host(arr.reshape(-1))).reshape(t.shape)
    return dtypes.numpy_to_cpu_tensor(to_host(arr))


@handler(aten.copy_.default)
def copy_(args, kwargs):
    """aten::copy_ - write ``src`` into ``self``, casting and broadcasting; any device pair."""
    dst, src = args[0], args[1]
    if not isinstance(dst, JaxTensor):  # tpu -> CPU
        dst.copy_(to_cpu(src))
        return dst
    if isinstance(src, JaxTensor):
        # ATen's copy_ refuses a source that partly shares the destination's memory
        # (``x[1:].copy_(x[:-1])``, ``x.t().copy_(x)``): its result would depend on the
        # order elements are written.
        writeback.check_no_partial_overlap(aten.copy_.default, [dst], [src], {})
        value = wrap(src._value(), src._device_index) if src._storage is dst._storage else src
    else:
        if loading() and awaits_legacy_bytes(src.untyped_storage()):
            # A device tensor of a legacy file rebuilt from its CPU copy before the
            # copy's bytes are read (Note [Legacy checkpoints]).
            defer_until_loaded(lambda: _copy_from_cpu(dst, src))
        return _copy_from_cpu(dst, src)
    return write_into(aten.copy_.default, dst, value, check_cast=False)


def _copy_from_cpu(dst: JaxTensor, src: torch.Tensor) -> JaxTensor:
    storage = dst._storage
    whole = (
        src.dtype == dst.dtype
        and tuple(src.shape) == dst._size
        and storage.covers(dst._size, dst._stride, dst._offset)
        and dst._stride == contiguous_strides(dst._size)
    )
    # Note [Host values put on the device when first read] (torchjax/tensor/_shadows.py)
    if whole and not fused.ACTIVE[0] and trace_state_clean() and _shadows.copy_later(storage, src):
        dst._cache_version = -1
        return dst
    with x64(True):  # also when a legacy load runs it again, outside dispatch
        out = write_into(aten.copy_.default, dst, wrap(cpu_to_jax(src)), check_cast=False)
    if whole:
        _shadows.remember(storage, src)  # Note [Host values of tensors made from host data]
    return out


def _copy_from(self, dst, non_blocking=False):
    # torch.tensor(data, device="tpu") copies below the Python dispatch key, so the copy
    # arrives here instead of in __torch_dispatch__; so do torch's own copies of a
    # host-backed tpu storage (``storage.cpu()``, the legacy writer), through plain tpu
    # tensors over it (Note [Host-backed tpu storages]).
    self, dst = host_view(self, reading=True), host_view(dst, reading=False)
    if not isinstance(self, JaxTensor) and not isinstance(dst, JaxTensor):
        return dst.copy_(self)
    with x64(True):
        return copy_((dst, self), {})


def _copy_from_and_resize(self, dst):
    with x64(True):
        if tuple(dst.shape) != tuple(self.shape):
            torch.ops.aten.resize_.default(dst, self.shape)
        return _copy_from(self, dst)


_LIB = torch.library.Library("aten", "IMPL", "PrivateUse1")
_LIB.impl("_copy_from", _copy_from)
_LIB.impl("_copy_from_and_resize", _copy_from_and_resize)


def _laid_out_on_cpu(t: JaxTensor, cpu: torch.Tensor, memory_format) -> torch.Tensor:
    """``cpu`` (contiguous) laid out as ``t.to("cpu", memory_format=...)`` lays out a
    CUDA tensor (Note [Memory formats on tpu] in torchjax/tensor/_memory_format.py)."""
    stride = result_strides(t._size, t._stride, memory_format)
    if stride == cpu.stride():
        return cpu
    return torch.empty_strided(cpu.shape, stride, dtype=cpu.dtype).copy_(cpu)


@handler(aten._to_copy.default)
def _to_copy(args, kwargs):
    """aten::_to_copy - ``.to(dtype/device)`` and ``.cpu()`` from a tpu tensor."""
    self = args[0]
    dtype = kwargs.get("dtype") or self.dtype
    device = kwargs.get("device")
    memory_format = kwargs.get("memory_format")
    if device is not None and torch.device(device).type == "cpu":
        return _laid_out_on_cpu(self, to_cpu(self).to(dtype), memory_format)
    jdt = dtypes.to_jax_dtype(dtype)
    stride = result_strides(self._size, self._stride, memory_format)
    contiguous = in_row_major_order(self._size, stride)
    same_device = device is None or (torch.device(device).index or 0) == self._device_index
    if contiguous and same_device and fused.ACTIVE[0]:
        # A copy or conversion of a recorded value is recorded too (Note [Fused eager]).
        pending = fused_reads.record_read(self, jdt)
        if pending is not None:
            # Note [Size-1 strides in fused eager]: a recorded copy stays recorded.
            return restrided(fused.wrap(pending, self._device_index), stride)
    index = self._device_index if device is None else torch.device(device).index or 0

    def convert(arr):
        arr = astype(arr, jdt) if arr.dtype != jdt else jnp.array(arr, copy=True)
        if index != self._device_index:
            arr = jax.device_put(arr, jax_device(index))
        return arr

    if not contiguous:
        if same_device and fused.ACTIVE[0]:
            recorded = _laid_out_recorded(self, stride, jdt)
            if recorded is not None:
                return recorded
        return laid_out(self, stride, convert, index)
    if index == self._device_index and dtype != self.dtype:
        deferred = deferred_casts.defer(self, jdt, dtype, stride)
        if deferred is not None:  # Note [Conversions read by their consumers]
            return deferred
    return restrided(wrap(convert(self._value()), index), stride)


def _laid_out_recorded(t, stride, jdt=None):
    """``laid_out(t, stride)`` (cast to ``jdt`` if given) recorded in this thread's
    segment, or None where ``t`` is not a recorded value of a recording thread: its data
    in memory order is the view of ``t`` with its dimensions permuted, one recorded view
    read (a copy of a transposed activation, as SDPA and backward make, goes on in the
    segment instead of running it; Note [Fused eager])."""
    size = t._size
    if math.prod(size) == 0 or not is_dense_permutation(size, stride):
        return None
    order = memory_order(size, stride)
    permuted = tuple(size[d] for d in order), tuple(t._stride[d] for d in order)
    pending = fused_reads.record_read(view_of(t, *permuted, t._offset), jdt)
    if pending is None:
        return None
    physical = fused.wrap(pending, t._device_index)
    return make(physical._storage, size, tuple(stride), 0, physical.dtype, t._device_index)


@handler(aten.detach.default, aten.alias.default, aten._unsafe_view.default)
def alias(args, kwargs):
    """aten::detach / alias - a new tensor sharing ``self``'s storage."""
    self = args[0]
    if len(args) > 1:  # _unsafe_view(self, size): a view whose result torch treats as fresh
        return aten.view.default(self, args[1])
    # Not read where that would run a recorded segment (Note [Fused eager]) or put host
    # values on the device (Note [Host values put on the device when first read]). The
    # value only seeds the alias's read cache: a view of a recorded value (a transposed
    # activation that autograd detaches in backward) is read later, through a recorded
    # view read, so the segment goes on.
    lazy = self._storage.lazy.__class__
    unread = lazy is HostValues or (lazy is fused.Pending and fused.recording())
    value = None if unread else self._value()
    return view_of(self, self._size, self._stride, self._offset, value=value)


# Note [torch.tensor on tpu under a fake mode]
# ``torch.tensor(7.0, device="tpu")`` inside torch.compile: torch's constructor makes the
# tensor for real, with the fake mode out of the way (FakeTensorMode avoids that only
# when no accelerator backend is registered), and hands it to ``lift_fresh`` under the
# mode. The mode leaves a tensor subclass to its own dispatch, so the real JaxTensor came
# back as the traced node's value, and Dynamo refused it where it checks fakes strictly
# (``y[y < 0] = torch.tensor(7.0, device=y.device)``: "Expected fake mode of e to be
# tx.fake_mode"). Lifted under a fake mode, it becomes its fake twin, as any real tpu
# tensor an op meets there does (Note [JaxTensor under Dynamo]); the graph keeps the
# constructor call, which the backend runs for real.
@handler(aten.lift_fresh.default)
def lift_fresh(args, kwargs):
    """aten::lift_fresh - ``torch.tensor``'s result, as a new tensor sharing its storage."""
    mode = active_fake_mode()
    if mode is not None:
        return _fake.twin(args[0], mode)
    return alias(args, kwargs)


@handler(aten.clone.default)
def clone(args, kwargs):
    """aten::clone - a copy at the strides ``memory_format`` gives (Note [Memory formats
    on tpu] in torchjax/tensor/_memory_format.py)."""
    self = args[0]
    stride = result_strides(self._size, self._stride, kwargs.get("memory_format"))
    if stride != contiguous_strides(self._size) and not in_row_major_order(self._size, stride):
        if fused.ACTIVE[0]:
            recorded = _laid_out_recorded(self, stride)
            if recorded is not None:
                return recorded
        return laid_out(self, stride)
    if fused.ACTIVE[0]:
        pending = fused_reads.record_read(self)  # recorded (Note [Fused eager])
        if pending is not None:  # Note [Size-1 strides in fused eager]
            return restrided(fused.wrap(pending, self._device_index), stride)
    return restrided(wrap(self._value(), self._device_index), stride)


# aten::item reaches us itself when a decomposition calls it below autograd (one_hot's).
@handler(aten._local_scalar_dense.default, aten.item.default)
def _local_scalar_dense(args, kwargs):
    """aten::_local_scalar_dense - ``.item()``: the Python number (blocks)."""
    known = _shadows.lookup(args[0])  # Note [Host values of tensors made from host data]
    if known is not None:
        _checks.raise_pending()
        return known.item()
    arr = args[0]._value()
    return to_host(arr.reshape(-1) if arr.ndim > 64 else arr).item()  # NumPy's 64 dims


def _local_scalar_dense_below_python(self):
    # ``torch.tensor([a, b])`` of 0-d tpu tensors reads each with the Python key
    # excluded (torch/csrc/utils/tensor_new.cpp), so the call lands on PrivateUse1: it
    # goes back through the tensor's dispatch (fused flush, queued device checks).
    return JaxTensor.__torch_dispatch__(aten._local_scalar_dense.default, (), (self,), {})


_LIB.impl("_local_scalar_dense", _local_scalar_dense_below_python)


@handler(aten.set_.source_Tensor)
def set_source_tensor(args, kwargs):
    """aten::set_(source) - make ``self`` alias ``source``'s storage and view."""
    self, src = args[0], args[1]
    self._rebind(src._storage, src._size, src._stride, src._offset, src.dtype)
    return self


@handler(aten.set_.source_Tensor_storage_offset)
def set_source_tensor_view(args, kwargs):
    """aten::set_(source, offset, size, stride) - alias ``source``'s storage at a view."""
    self, src, offset, size = args[0], args[1], args[2], tuple(args[3])
    stride = tuple(args[4]) if len(args) > 4 and args[4] else contiguous_strides(size)
    self._rebind(src._storage, size, stride, offset, src.dtype)
    return self


@handler(aten.set_.source_Storage, aten.set_.source_Storage_storage_offset)
def set_source_storage(args, kwargs):
    """aten::set_(storage, offset, size, stride) - view a tpu tensor's storage (Note
    [torch storages of tpu tensors] in torchjax/tensor/_addresses.py) or a storage
    restored to tpu by torch.load (Note [Loading checkpoints onto tpu] in
    torchjax/device/_serialization.py)."""
    self, source = args[0], args[1]
    if len(args) > 2:
        offset, size = args[2], tuple(args[3])
        stride = tuple(args[4]) if len(args) > 4 and args[4] else contiguous_strides(size)
    else:
        offset, size, stride = 0, None, None
    untyped = untyped_storage_of(source)
    view = None if is_host_backed(untyped) else storage_view(self, untyped, offset, size, stride)
    if view is not None:
        self._rebind(*view, self.dtype)
        return self
    index = self._device_index

    def make_storage(flat: torch.Tensor) -> Storage:
        with x64(True):  # also when a legacy load fills it again, outside dispatch
            arr = cpu_to_jax(flat)
        return Storage(jax.device_put(arr, jax_device(index)) if index else arr)

    storage = storage_for(source, self.dtype, self.device, make_storage)
    if size is None:  # set_(storage): the whole storage, 1-d
        size, stride = (storage.numel,), (1,)
    self._rebind(storage, size, stride, offset, self.dtype)
    return self


@handler(aten.resize_.default)
def resize_(args, kwargs):
    """aten::resize_ - as CPU: the tensor keeps its storage and offset and takes
    contiguous strides, so it reads the storage in storage order and stays aliased with
    every other view of it; a storage too small is grown in place, with zeros where CPU
    leaves memory uninitialised."""
    self, size = args[0], tuple(args[1])
    memory_format = kwargs.get("memory_format", args[2] if len(args) > 2 else None)
    stride = None
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    if size != self._size or (stride is not None and stride != self._stride):
        self._resize(size, stride)
    return self


@lowering(aten.zero.default)
def zero(self):
    """aten::zero - zeros of ``self``'s shape and dtype."""
    return jnp.zeros_like(self)


@lowering(aten.fill.Scalar, aten.fill.Tensor, aten.fill_.Tensor)
def fill(self, value):
    """aten::fill - every element set to ``value`` cast to ``self``'s dtype."""
    return jnp.full(self.shape, value, dtype=self.dtype)


# fill_ with a number and zero_ write one value everywhere, so torch lets them write a
# tensor whose elements share memory (``x.expand(4, 3).fill_(1)``: ATen's fill skips
# TensorIterator's internal-overlap check); every other in-place op, fill_ with a tensor
# value included, refuses such a tensor. The value is
# written through the view with its broadcast (stride-0) dimensions collapsed to one
# element, which writes each memory location once.
@handler(aten.fill_.Scalar, aten.zero_.default)
def fill_(args, kwargs):
    """aten::fill_.Scalar / aten::zero_ - ``self`` with every element set to the value."""
    self = args[0]
    if not isinstance(self, JaxTensor):
        raise TypeError(f"torchjax: fill_ of a {type(self).__name__}")
    if len(args) > 1 and not (self.numel() == 1 and dtypes.is_half(self.dtype)):
        # CPU fills a one-element tensor through a path that checks the number against
        # every type but float16/bfloat16/float8 (where(cond, x_f16, 1e5) gives inf).
        dtypes.check_scalar_fits(args[1], self.dtype, "fill_")
    storage = self._storage
    # (A view of another dtype has an Interpretation here, never a fill to record.)
    lazy = getattr(storage, "lazy", None)
    if lazy is not None and storage.covers(self._size, self._stride, self._offset):
        # A new large tensor: the fill is recorded, no array made (Note [Storages filled
        # on first read] in torchjax/tensor/_storage.py).
        if self._stride == contiguous_strides(self._size) and storage.set_fill(
            0 if len(args) == 1 else args[1]
        ):
            return self
    size = tuple(1 if st == 0 else n for n, st in zip(self._size, self._stride))
    target = self if size == self._size else view_of(self, size, self._stride, self._offset)
    if len(args) == 1:
        value = aten.zero.default(target)
    else:
        value = aten.fill.Scalar(target, args[1])
    write_into(aten.fill_.Scalar, target, value, check_cast=False)
    return self


@lowering(aten.copy.default)
def copy(self, src, non_blocking=False):
    """aten::copy - functional copy_: ``src`` cast to ``self``'s dtype, broadcast to its
    shape (torch's decompositions use it)."""
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


def _storage_numel(t) -> int:
    """Elements of ``t``'s dtype its storage holds (``storage.nbytes() / itemsize``)."""
    if not isinstance(t, JaxTensor):
        return t.untyped_storage().nbytes() // t.element_size()
    storage = t._storage
    return storage.numel * storage.arr.dtype.itemsize // t.element_size()


@handler(aten._has_same_storage_numel.default)
def _has_same_storage_numel(args, kwargs):
    """aten::_has_same_storage_numel - whether both storages hold the same number of
    elements of each tensor's dtype; forward-mode AD (``make_dual``) asks it before
    sharing a tangent's storage."""
    return _storage_numel(args[0]) == _storage_numel(args[1])


@handler(aten._new_zeros_with_same_feature_meta.default)
def _new_zeros_with_same_feature_meta(args, kwargs):
    """aten::_new_zeros_with_same_feature_meta - zeros laid out as ``other`` (over a
    storage of its size, at its strides and offset), behind ``self``'s first
    ``self_num_batch_dims`` dimensions: forward-mode AD makes a tangent with the
    primal's layout with it. Reference: ATen's function of that name."""
    if active_proxy_mode() is not None:
        # make_fx over tpu tensors loses the tangent's chain (torch.func.linearize gave
        # zeros): refuse rather than trace a wrong graph.
        raise NotImplementedError(
            "aten::_new_zeros_with_same_feature_meta: forward-mode AD under make_fx "
            "(torch.func.linearize) is not supported for tpu tensors; use torch.func.jvp "
            "or torch.autograd.forward_ad directly"
        )
    self, other = args[0], args[1]
    batch = kwargs.get("self_num_batch_dims", args[2] if len(args) > 2 else 0)
    strides = list(other.stride())
    numel = _storage_numel(other)
    for n in reversed(tuple(self.shape[:batch])):
        strides.insert(0, numel)
        numel *= n
    zeros = aten.zeros.default([numel], dtype=other.dtype, device=other.device)
    sizes = [*self.shape[:batch], *other.shape]
    return aten.as_strided.default(zeros, sizes, strides, other.storage_offset())


@handler(aten.is_set_to.default)
def is_set_to(args, kwargs):
    """aten::is_set_to - whether ``self`` and ``tensor`` are the same storage at the same
    storage offset, sizes and strides (ATen's CPU kernel; dtypes are not compared, so a
    same-size dtype view of a tensor is set to it). A tpu tensor's storage is its root
    Storage, a dtype interpretation included (Note [torch storages of tpu tensors]); a
    CPU tensor never shares one with a tpu tensor."""
    bound = dict(zip(("self", "tensor"), args), **kwargs)
    a, b = bound["self"], bound["tensor"]
    roots = [root_of(t._storage) if isinstance(t, JaxTensor) else None for t in (a, b)]
    return (
        roots[0] is not None
        and roots[0] is roots[1]
        and a.storage_offset() == b.storage_offset()
        and a.size() == b.size()
        and a.stride() == b.stride()
    )


@handler(aten.is_pinned.default)
def is_pinned(args, kwargs):
    """aten::is_pinned - False: only CPU tensors can be pinned, as torch answers for a
    CUDA tensor (its CompositeExplicitAutograd kernel runs, with its deprecation warning
    for a ``device`` argument)."""
    return call_composite_explicit(aten.is_pinned.default, *args, **kwargs)
