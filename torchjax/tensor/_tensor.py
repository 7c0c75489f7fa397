"""JaxTensor: a torch.Tensor on device "tpu" whose data is a jax.Array.

A JaxTensor is a wrapper subclass (``_make_wrapper_subclass``): torch sees its sizes,
strides, dtype and device, autograd runs above it as for any tensor, and every ATen op
that reaches it arrives in ``__torch_dispatch__``, which hands it to the op registry
(torchjax/ops/registry.py). The data lives in a ``Storage`` shared by all views of it:
see Note [Aliasing through views] in torchjax/tensor/_storage.py.

There is no mode to be inside of: a JaxTensor works wherever it goes, including worker
threads and after any context manager exits.
"""

from __future__ import annotations

import math
import threading
import weakref

import jax
import numpy as np
import torch

from torchjax._compat.jax import x64_enter, x64_exit
from torchjax._compat.torch import (
    autograd_view_func,
    disabled_torch_function_impl,
    set_math_bits,
    set_tensor_data,
    tensor_repr,
)
from torchjax.tensor import (
    _addresses,
    _backward_errors,
    _errors,
    _fake,
    _protocols,
    _shadows,
    dtypes,
)
from torchjax.tensor._reinterpret import Interpretation, interpret
from torchjax.tensor._shared_arrays import remember
from torchjax.tensor._storage import Storage, contiguous_strides

DEVICE_TYPE = "tpu"
_DEVICES = {}
# The registry's resolved handlers (ATen overload -> fn(args, kwargs)); filled by
# torchjax/ops/registry.py, which imports this module. Read directly on the hot path.
_HANDLERS: dict = {}
# Ops run on the host when their inputs' values are there (ATen overload -> fn(func,
# args, kwargs), None to run on the device); filled by torchjax/ops/host_ops.py (Note
# [Integer ops on host values]).
HOST_OPS: dict = {}
# The device checks not read yet and the function that has the end of a running backward
# pass read them (Note [Device-side checks]); set by torchjax/device/_checks.py, which
# this module cannot import (the device package imports it).
_PENDING_CHECKS: list = []
_at_backward_op = None
# How many threads are tracing a torchjax.jit program, and this thread's argument hook
# while it does (Note [Stopped gradients in compiled programs] in
# torchjax/compile/_stop_gradient.py, which fills them): one list read per eager op.
ARG_HOOKS: list = [0]
HOOK = threading.local()


def make(
    storage: Storage, size, stride, offset, dtype, device_index=0, requires_grad=False
) -> JaxTensor:
    """A tpu tensor viewing ``storage`` at (size, stride, offset)."""
    t = torch.Tensor._make_wrapper_subclass(
        JaxTensor,
        size,
        strides=stride,
        storage_offset=offset,
        dtype=dtype,
        device=tpu_device(device_index),
        requires_grad=requires_grad,
    )
    t._storage = storage
    t._size = tuple(size)
    t._stride = tuple(stride)
    t._offset = offset
    t._device_index = device_index
    t._cache = None
    t._cache_version = -1
    return t


def tpu_device(index: int = 0) -> torch.device:
    dev = _DEVICES.get(index)
    if dev is None:
        dev = _DEVICES[index] = torch.device(DEVICE_TYPE, index)
    return dev


class JaxTensor(torch.Tensor):
    """A torch tensor on "tpu" backed by a jax.Array (see module docstring).

    Attributes (private): ``_storage`` the shared Storage; ``_size``, ``_stride``,
    ``_offset`` its view into the storage (mirroring the TensorImpl metadata);
    ``_cache``/``_cache_version`` the last value read and the storage version it saw.
    """

    __torch_function__ = disabled_torch_function_impl

    # Class-level defaults, so ``wrap`` (once per op result) sets fewer attributes.
    _offset = 0
    _device_index = 0
    _cache = None
    _cache_version = -1

    @staticmethod
    def __new__(cls, *args, **kwargs):
        # The public constructor forms: Note [Constructing a JaxTensor like a tensor class]
        # in torchjax/tensor/_protocols.py. torchjax itself builds tensors with ``make``.
        return _protocols.construct(args, kwargs)

    def __init__(self, *args, **kwargs):
        pass

    # -- data -----------------------------------------------------------------------
    def jax(self) -> jax.Array:
        """The tensor's value as a jax.Array (shape ``self.shape``, dtype matching).

        A method, as in torchax: transformers' ``is_jax_jitting(x)`` calls ``x.jax()`` and
        skips data-dependent shortcuts (reading a padding mask's values) when it returns
        a tracer, i.e. under torchjax.jit.
        """
        return self._value()

    def _value(self) -> jax.Array:
        storage = self._storage
        if self._cache_version == storage.version:
            return self._cache
        arr = storage.read(self._size, self._stride, self._offset)
        self._cache = arr
        self._cache_version = storage.version
        return arr

    def _value_uncached(self) -> jax.Array:
        """``_value()`` without keeping a newly computed value in the read cache: for a
        read made once (a save writing views one at a time), where the cache would keep
        every view's copy alive in device memory as long as the views live."""
        storage = self._storage
        if self._cache_version == storage.version:
            return self._cache
        return storage.read(self._size, self._stride, self._offset)

    def _write(self, arr: jax.Array) -> None:
        """Store ``arr`` (exact shape and dtype of self) into this tensor's elements."""
        self._storage.write(self._size, self._stride, self._offset, arr)
        self._cache = arr
        self._cache_version = self._storage.version

    def _resize(self, size, stride=None) -> None:
        """``resize_`` as CPU: keep the storage and offset, take contiguous strides (or
        ``stride``, a memory format's), grow the storage in place when it is too small
        (zeros where CPU leaves memory uninitialised), so every other view of it stays
        aliased."""
        size = tuple(size)
        stride = contiguous_strides(size) if stride is None else tuple(stride)
        storage, offset = self._storage, self._offset
        span = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if 0 not in size else 0
        if offset + span > storage.numel:
            storage.grow(offset + span)
        self._rebind(storage, size, stride, offset)

    def _rebind(self, storage: Storage, size, stride, offset, dtype=None) -> None:
        """Point this Python object at another view/storage, metadata included."""
        other = make(storage, size, stride, offset, dtype or self.dtype, self._device_index)
        set_tensor_data(self, other)
        self._storage = storage
        self._size, self._stride, self._offset = tuple(size), tuple(stride), offset
        self._cache, self._cache_version = None, -1

    # -- conversions users reach for --------------------------------------------------
    def numpy(self, *, force: bool = False) -> np.ndarray:
        """A read-only NumPy copy of the data. A CPU tensor's ``numpy()`` shares its
        memory, so writes to the array change the tensor; a tpu tensor's cannot, and a
        writable copy would drop such writes silently. Read-only, as ``np.asarray`` of a
        jax array is, the write raises instead; ``.cpu().numpy()`` gives a writable
        array sharing a CPU tensor's memory."""
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use "
                "tensor.detach().numpy() instead."
            )
        out = self.cpu().numpy()
        out.flags.writeable = False
        return out

    # DLPack: the jax array's own protocol (zero copy where jax allows it: CPU arrays,
    # or GPU arrays to a GPU consumer), so torch.from_dlpack(t) and
    # jax.dlpack.from_dlpack(t) work; torch's C++ export knows no data behind a wrapper.
    def __dlpack__(self, *args, **kwargs):
        return remember(self._value()).__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._value().__dlpack_device__()

    def data_ptr(self) -> int:
        """An address for identity, not for reading: unique per storage, views offset
        within it (Note [Addresses of tpu tensors] in torchjax/tensor/_addresses.py)."""
        return _addresses.address(self._storage) + self._offset * self.element_size()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The tpu storage of the root this tensor views: one per root, its ``data_ptr()``
        the root's address (Note [torch storages of tpu tensors] in
        torchjax/tensor/_addresses.py). ``storage()`` reads it too."""
        storage = self.__dict__.get("_storage")
        if storage is None:  # a fake tensor under torch.compile: its inner fake's, which
            # its views share (Note [JaxTensor under Dynamo])
            return _fake.inner(self).untyped_storage()
        return _addresses.untyped_storage(storage, self.device)

    def set_(self, *args, **kwargs):
        # Dynamo's meta converter points a fake at a shared fake storage (Note [Inputs
        # sharing a storage] in torchjax/tensor/_fake.py); every other call is torch's.
        if _fake.is_fake(self) and _fake.set_storage(self, args, kwargs):
            return self
        return torch.Tensor.set_(self, *args, **kwargs)

    def tolist(self):
        return self.detach().cpu().tolist()

    def __format__(self, format_spec):
        # torch formats 0-d plain tensors as their Python number; do the same on tpu.
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):
        if _fake.is_fake(self):  # inside torch.compile tracing: no values to show
            return (
                f"FakeJaxTensor(size={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
            )
        # A user's subclass prints its class name, as on CUDA; its CPU copy is of that
        # class, and torch formats only plain tensors' elements as numbers (Note [User
        # tensor subclasses on tpu]).
        wrapper = type(self) is JaxTensor
        return tensor_repr(self, self.detach().cpu().as_subclass(torch.Tensor), wrapper)

    # torch's versions of these read the (empty) TensorImpl storage; these read the
    # Storage (torchjax/tensor/_protocols.py).
    def __deepcopy__(self, memo):
        return _protocols.deepcopy(self, memo)

    def __reduce_ex__(self, proto):
        return _protocols.reduce_ex(self, proto)

    def as_subclass(self, cls):
        # A tpu tensor already is a plain torch.Tensor to its users (its class is the
        # device's wrapper): ``as_subclass(torch.Tensor)``, which torch's rebuild of a
        # pickled tensor with attributes calls, is the tensor itself. torch's version
        # would make an autograd alias, so a loaded leaf came back a non-leaf.
        from torchjax.tensor import _user_subclass  # it builds on this module

        if cls is torch.Tensor:
            # A user's subclass on tpu becomes the device's plain class: an alias, as
            # CPU's ``as_subclass`` gives.
            return self if type(self) is JaxTensor else _user_subclass.alias_as(self, JaxTensor)

        made = _user_subclass.tpu_class(cls)
        if made is None:
            return super().as_subclass(cls)
        return _user_subclass.alias_as(self, made)

    def register_hook(self, hook):
        # Note [Errors inside the autograd engine] (_backward_errors.py): a hook raising
        # inside the engine would abort the process on this device.
        return super().register_hook(_backward_errors.guarded(hook))

    def register_post_accumulate_grad_hook(self, hook):
        return super().register_post_accumulate_grad_hook(_backward_errors.guarded(hook))

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"Variable data has to be a tensor, but got {type(new).__name__}")
        if not isinstance(new, JaxTensor):
            raise RuntimeError(
                f"torchjax: cannot assign .data of a tpu tensor from a {new.device} tensor; "
                "move it with .to('tpu') first"
            )
        set_tensor_data(self, new)
        self._storage = new._storage
        self._size, self._stride, self._offset = new._size, new._stride, new._offset
        self._cache, self._cache_version = None, -1

    # Note [Traceable wrapper subclass]
    # Defining __tensor_flatten__/__tensor_unflatten__ makes JaxTensor a "traceable wrapper
    # subclass". nn.Module._apply then moves parameters with torch.utils.swap_tensors,
    # keeping each Parameter object (and so tied weights: `lm_head.weight is
    # embed_tokens.weight`) instead of creating new Parameters per module. The one inner
    # tensor is a data-less stand-in that only torch.compile looks at (Note [JaxTensor
    # under Dynamo] in torchjax/tensor/_fake.py); the data travels in the context.
    def __tensor_flatten__(self):
        kind = "fake" if _fake.is_fake(self) else "real"
        storage = self.__dict__.get("_storage")
        # The storage by weak reference: Dynamo keeps a compiled graph's input contexts
        # in its guards for the graph's life, and a strong one kept each input's array
        # then (a parameter's or gradient's, the size of the model per graph).
        return ["_stand_in"], (
            kind,
            None if storage is None else weakref.ref(storage),
            tuple(self.shape),
            tuple(self.stride()),
            self.storage_offset(),
            self.dtype,
            self._device_index,
        )

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return _fake.unflatten(inner_tensors, ctx, outer_size, outer_stride)

    @classmethod
    def __metadata_guard__(cls, orig, other) -> bool:
        # Dynamo re-uses a graph for another JaxTensor of the same dtype and device;
        # sizes and strides have guards of their own.
        return orig[5:] == other[5:]

    def _view_func_unsafe(self, new_base, symint_visitor_fn=None, tensor_visitor_fn=None):
        # Dynamo replays a view input's chain on its fake base (Note [Replaying a view
        # input] in torchjax/tensor/_fake.py).
        return _fake.replay_view(
            self, autograd_view_func(self), new_base, symint_visitor_fn, tensor_visitor_fn
        )

    @property
    def _stand_in(self) -> torch.Tensor:
        inner = self.__dict__.get("_fake_inner")
        return inner if inner is not None else _fake.stand_in(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Every ATen op on a tpu tensor: x64 on for this thread (Note [x64 without
        # touching the user's JAX]; the cheap swap, not the context manager), then the
        # registry's handler for ``func`` (see Note [The eager hot path] in
        # torchjax/ops/registry.py).
        token = x64_enter()
        if _PENDING_CHECKS:  # the end of a backward pass reports them
            _at_backward_op()
        hooked = None
        if ARG_HOOKS[0]:
            hook = getattr(HOOK, "fn", None)
            if hook is not None:
                args, kwargs, hooked = hook(func, args, kwargs)
        try:
            if func in HOST_OPS and _shadows.HELD:
                # Note [Integer ops on host values] (torchjax/ops/host_ops.py)
                out = HOST_OPS[func](func, args, kwargs or {})
                if out is not None:
                    return out
            try:
                handler = _HANDLERS.get(func)
                if handler is None:
                    return _dispatch(func, args, kwargs or {})
                return handler(args, kwargs or {})
            except Exception as error:
                # Fake JaxTensors (torch.compile tracing) have no storage: every handler
                # fails on them, so checking here costs nothing on the hot path.
                if not _fake.any_fake(args, kwargs or {}):
                    if len(types) > 1 and _answered_elsewhere(types):
                        return NotImplemented  # Note [Tensor classes that answer tpu ops]
                    return _raise_or_defer(func, args, kwargs or {}, error)
            # Outside the except clause: an error of the fake run is the op's own, not
            # one raised while handling the registry's failure on a tensor without
            # storage (Note [Errors of ops traced with fake tensors]).
            return _fake.dispatch(func, args, kwargs or {})
        finally:
            if hooked is not None:
                HOOK.after(hooked)
            x64_exit(token)


def _raise_or_defer(func, args, kwargs, error):
    # torch's exception type and text, not JAX's (Note [One error layer]).
    torch_error = _errors.translate(func, args, kwargs, error)
    if not _backward_errors.in_backward():
        if torch_error is None:
            raise error
        raise torch_error from error
    if torch_error is not None:
        torch_error.__cause__ = error
        error = torch_error
    # See Note [Errors inside the autograd engine].
    return _backward_errors.defer(func, args, kwargs, error)


_protocols.register_forking_reduction(JaxTensor)


# Note [Tensor classes that answer tpu ops]
# torch calls the ``__torch_dispatch__`` of an op's tensor classes left to right (a
# subclass before its base), so ``addmm(bias, packed, weight)`` reaches JaxTensor's
# before that of ``packed``'s class, a tpu tensor class torchjax defines for something a
# JaxTensor cannot be (the stand-in for a nested tensor: torchjax/ops/
# transformer_nested.py). A handler fails on such an argument (it holds no storage); the
# failure is then not the call's answer: JaxTensor returns NotImplemented, and torch asks
# the next class, which answers or refuses with its own message. A class says so with a
# true ``_answers_tpu_ops``. Looked at only on the error path.
def _answered_elsewhere(types) -> bool:
    return any(getattr(t, "_answers_tpu_ops", False) for t in types)


# Note [The class name in Python's messages]
# Python names an object's class by its type's ``__name__`` in the TypeErrors and
# AttributeErrors it raises itself ("unsupported operand type(s) for +: 'Tensor' and
# 'str'", "'Tensor' object has no attribute 'foo'"), and torch's argument parser does the
# same in "got (Tensor, str)" and marks an argument whose class is not named ``Tensor`` as
# mismatched. A tpu tensor is a plain torch.Tensor to its users, so those messages say
# ``Tensor``, as on CPU. ``__qualname__`` stays ``JaxTensor``: ``repr(type(t))``, pickling
# by reference and the import path still name this class.
JaxTensor.__name__ = "Tensor"


# (shape, jax dtype) -> (size, contiguous strides, numel, torch dtype): the metadata of a
# fresh contiguous tensor, computed once per shape and dtype instead of once per op.
_CONTIGUOUS_META: dict = {}


def wrap(arr: jax.Array, device_index: int = 0) -> JaxTensor:
    """A new tpu tensor owning ``arr`` (contiguous, fresh storage).

    Metadata comes from the array's aval (shape, dtype): no device data is touched, so
    wrapping never waits for the computation producing ``arr``."""
    shape, dtype = arr.shape, arr.dtype
    meta = _CONTIGUOUS_META.get((shape, dtype))
    if meta is None:
        if len(_CONTIGUOUS_META) > 8192:
            _CONTIGUOUS_META.clear()
        dtypes.note_emulated_float64(arr, dtype)
        size = tuple(shape)
        meta = _CONTIGUOUS_META[(shape, dtype)] = (
            size,
            contiguous_strides(size),
            math.prod(size),
            dtypes.to_torch_dtype(dtype),
        )
    size, stride, numel, torch_dtype = meta
    # Contiguous strides and offset 0 are _make_wrapper_subclass's defaults (cheaper
    # than passing them); _offset and _device_index 0 are class defaults.
    t = _make_wrapper_subclass(
        JaxTensor,
        size,
        dtype=torch_dtype,
        device=_DEVICES.get(device_index) or tpu_device(device_index),
    )
    t._storage = Storage(arr, size, numel)
    t._size = size
    t._stride = stride
    if device_index:
        t._device_index = device_index
    t._cache = arr
    t._cache_version = 0
    return t


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def view_of(
    base: JaxTensor, size, stride, offset, dtype=None, value=None, conj=None, neg=None
) -> JaxTensor:
    """A tensor aliasing ``base``'s storage; ``value`` (if given) seeds its read cache.

    ``dtype`` other than ``base``'s, or ``conj``/``neg`` bits other than ``base``'s (the
    default keeps them, as torch's views do), read the storage through an interpretation
    (Note [Views across dtypes] in torchjax/tensor/_reinterpret.py)."""
    storage = base._storage
    dtype = dtype or base.dtype
    # The bits follow the interpretation (set together below), read without a C call.
    bits = (storage.conj, storage.neg) if storage.__class__ is Interpretation else (False, False)
    want = (bits[0] if conj is None else conj, bits[1] if neg is None else neg)
    if dtype != base.dtype or want != bits:
        storage = interpret(storage, dtypes.to_jax_dtype(dtype), *want)
    if torch.is_inference_mode_enabled() and not base.is_inference():
        # Note [Views of normal tensors in inference mode]: as on CPU, a view of a
        # normal tensor made under inference_mode is a normal tensor. Made there, the
        # wrapper would be an inference tensor, and torch's C++ then fails giving it the
        # base's version counter ("Cannot set version_counter for inference tensor").
        with torch.inference_mode(False):
            t = make(storage, size, stride, offset, dtype, base._device_index)
    else:
        t = make(storage, size, stride, offset, dtype, base._device_index)
    if want != (False, False):
        set_math_bits(t, *want)
    if value is not None:
        t._cache = value
        t._cache_version = base._storage.version
    return t


def _dispatch(func, args, kwargs):
    # Replaced by torchjax/ops/registry.py's dispatch when the op table loads: ops is the
    # layer above this one.
    raise RuntimeError(
        f"{func}: the tpu op table is not loaded; import torchjax (not only torchjax.tensor)"
    )
