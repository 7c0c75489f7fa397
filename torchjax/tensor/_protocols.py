"""Python object protocols of JaxTensor: the public constructor, deepcopy, pickling.

torch implements these for tensors in terms of their storage (``Tensor.__deepcopy__``
clones ``untyped_storage()``, pickling saves it). A JaxTensor's TensorImpl storage is
an empty placeholder (the data is a jax array in a ``Storage``), so each protocol is
answered here from the ``Storage`` instead, with the same results as on CPU.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import jax.numpy as jnp
import torch

from torchjax._compat.jax import x64
from torchjax._compat.torch import (
    rebuild_device_tensor_args,
    rebuild_parameter_args,
    rebuild_tensor_args,
    tensor_metadata,
    with_state_args,
)
from torchjax.tensor import _fake, _host_storage
from torchjax.tensor._reinterpret import interpret
from torchjax.tensor.dtypes import to_jax_dtype

# __dict__ entries that are a JaxTensor's own machinery, not user state: the view into
# its Storage, the read cache, what torch.compile attached (Note [JaxTensor under
# Dynamo]) and torch's cached size/stride capsules.
INTERNAL = frozenset(
    {
        "_storage",
        "_size",
        "_stride",
        "_offset",
        "_device_index",
        "_cache",
        "_cache_version",
        "_stand_in_tensor",
        "_fake_inner",
        "_sym_sizes_capsule",
        "_sym_sizes_capsule_len",
        "_sym_strides_capsule",
        "_sym_strides_capsule_len",
    }
)


def user_state(t, *, drop=()) -> dict:
    """The attributes a user or library set on ``t`` (what torch pickles/deep-copies)."""
    return {k: v for k, v in t.__dict__.items() if k not in INTERNAL and k not in drop}


# Note [Constructing a JaxTensor like a tensor class]
# Libraries make "another tensor of this kind" with the tensor's class: accelerate's
# offload hooks call ``type(param)(value, requires_grad=...)``, others ``t.__class__(x)``.
# A tpu parameter's class is JaxTensor (``nn.Parameter(t)`` of a wrapper subclass marks
# the tensor ``_is_param`` instead of changing its class), so JaxTensor's constructor
# answers what the class of the same tensor on CUDA would: with ``requires_grad`` (the
# Parameter signature) it is ``nn.Parameter(data, requires_grad)``; otherwise it is
# ``torch.Tensor(*args)`` (an alias of a tensor argument, or the legacy size forms).
# Either way the result lives on the data's device, as for a plain tensor.
def construct(args, kwargs):
    """``JaxTensor(...)`` called by user code (see the Note above)."""
    if "requires_grad" in kwargs or (len(args) == 2 and isinstance(args[1], bool)):
        data = args[0] if args else kwargs.pop("data", None)
        requires_grad = args[1] if len(args) == 2 else kwargs.pop("requires_grad")
        if kwargs:
            raise TypeError(
                f"JaxTensor(data, requires_grad) got unexpected keyword arguments {sorted(kwargs)}"
            )
        return torch.nn.Parameter(data, requires_grad)
    return torch.Tensor(*args, **kwargs)


def _not_leaf_error() -> RuntimeError:
    # torch's own message (torch/_tensor.py, Tensor.__deepcopy__).
    return RuntimeError(
        "Only Tensors created explicitly by the user "
        "(graph leaves) support the deepcopy protocol at the moment.  "
        "If you were attempting to deepcopy a module, this may be because "
        "of a torch.nn.utils.weight_norm usage, "
        "see https://github.com/pytorch/pytorch/pull/103001"
    )


def preserve_format_clone(t):
    """A fresh-storage copy of ``t`` with ``clone(memory_format=torch.preserve_format)``'s
    strides (Note [Memory formats on tpu]): a physical copy, never ``t``'s array."""
    from torchjax.tensor._memory_format import laid_out, result_strides

    stride = result_strides(t._size, t._stride, torch.preserve_format)
    with x64(True):
        return laid_out(t, stride, convert=jnp.copy)


def deepcopy(t, memo):
    """``copy.deepcopy`` of a tpu tensor, as torch deep-copies a CPU one.

    A plain tensor gets a copy of its whole storage at the same view (size, stride,
    offset); the storage copy is memoised, so views deep-copied in one call alias each
    other as their originals do. A parameter is cloned (``nn.Parameter.__deepcopy__``:
    grad and attributes are not copied)."""
    from torchjax.tensor._tensor import make

    if not t.is_leaf:
        raise _not_leaf_error()
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        if _fake.is_fake(t):  # under torch.compile tracing: no storage to copy
            new = t.clone()
        elif t.__dict__.get("_is_param"):
            new = torch.nn.Parameter(preserve_format_clone(t), t.requires_grad)
            memo[id(t)] = new
            return new
        else:
            storage = copy.deepcopy(t._storage, memo)
            new = make(storage, t._size, t._stride, t._offset, t.dtype, t._device_index)
            new.__class__ = type(t)  # a user's subclass (Note [User tensor subclasses on tpu])
    if t.requires_grad:
        new.requires_grad_()
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    for key, value in user_state(t).items():
        new.__dict__[key] = copy.deepcopy(value, memo)
    memo[id(t)] = new
    return new


# Note [Saving tpu tensors]
# torch pickles a tensor with a storage as that storage plus a view of it
# (``_rebuild_tensor_v2``); ``torch.save`` writes each storage once, so tensors that
# share memory share it again after loading, and ``copy.copy`` rebuilds over the same
# storage. torch's default for a storage-less backend, a CPU copy per tensor
# (``_rebuild_device_tensor_from_cpu_tensor``), loses both, and the legacy
# (non-zipfile) format even reads that copy before its bytes are in: garbage. So a tpu
# tensor pickles as its root Storage's bytes in a host-backed tpu storage (Note
# [Host-backed tpu storages] in torchjax/tensor/_host_storage.py) plus its own size,
# stride and offset, in the units of its dtype, as on CPU; attributes set on it travel
# as a CPU tensor's do (``_rebuild_from_type_v2`` with ``torch.Tensor``, whose
# ``as_subclass`` a JaxTensor answers with itself). Files load anywhere torch
# loads CPU tensors with ``map_location="cpu"``, and with ``weights_only=True``. A
# conjugate or negative view is saved as CPU saves it: its storage's plain values and
# the bit as tensor metadata (``is_conj()``/``is_neg()`` and sharing with the tensors of
# that storage hold after loading); torch sets the bit after the rebuild, and the load
# turns the rebuilt tpu tensor into that view then (``math_bits_loaded``).
# multiprocessing's pickler shares a storage through shared memory, which only CPU
# storages support; a tpu tensor crosses processes as its values, rebuilt on the device
# (``forking_reduce``). The values travel as bytes in the pickle, not as a CPU tensor
# for torch's reductions to share: that tensor would be a temporary, and the "spawn"
# start method passes a shared storage's file descriptor by number when the child
# starts, after the temporary (and its descriptor) is gone: the child failed with
# "unable to resize file".
def reduce_ex(t, proto):
    """``pickle`` / ``torch.save`` / ``copy.copy`` of a tpu tensor (Note [Saving tpu
    tensors]). A parameter goes through torch's parameter rebuild, with its attributes,
    as ``nn.Parameter.__reduce_ex__`` does."""
    if t.__dict__.get("_is_param"):
        return _reduce_parameter(t)
    from torchjax.tensor._user_subclass import user_class

    cls = user_class(type(t)) or torch.Tensor
    if _fake.is_fake(t):
        return with_state_args(_reduce_as_values(t), user_state(t), cls)
    root = t._storage
    root = getattr(root, "root", root)  # an Interpretation's (dtype view's) root
    storage = _host_storage.snapshot(root, t.device, t._device_index)
    metadata = tensor_metadata(t) if t.is_conj() or t.is_neg() else None
    reduced = rebuild_tensor_args(
        storage,
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.requires_grad,
        t.dtype,
        metadata,
    )
    return with_state_args(reduced, user_state(t), cls)


def math_bits_loaded(t) -> None:
    """torch.load set a saved conj / neg bit on ``t`` (Note [Saving tpu tensors]): a tpu
    tensor then reads its storage through those bits, as ``conj()``/``_neg_view()``
    views do; until now it read the plain values under the bit."""
    storage = getattr(t, "_storage", None)
    if storage is None or t.device.type != "tpu":
        return
    conj, neg = t.is_conj(), t.is_neg()
    view = interpret(storage, to_jax_dtype(t.dtype), conj, neg)
    if view is not storage:  # same size, stride and offset: only the reading changes
        t._storage = view
        t._cache, t._cache_version = None, -1


def forking_reduce(t):
    """A tpu tensor through ``multiprocessing.reduction.ForkingPickler`` (Note [Saving
    tpu tensors])."""
    if t.__dict__.get("_is_param"):
        return _reduce_parameter(t)
    cpu = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    data = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    return rebuild_from_bytes, (data, t.dtype, tuple(t.shape), str(t.device), t.requires_grad)


def rebuild_from_bytes(data: bytes, dtype, shape, device: str, requires_grad: bool):
    """The tpu tensor ``forking_reduce`` sent: its values' bytes, put on ``device``."""
    flat = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape(shape).to(device).requires_grad_(requires_grad)


def _reduce_parameter(t):
    with torch.no_grad():
        data = t.detach()  # a plain (non-parameter) view of the same data
    return rebuild_parameter_args(
        data, t.requires_grad, OrderedDict(), user_state(t, drop={"_is_param"})
    )


def _reduce_as_values(t):
    """Its values in a CPU tensor, rebuilt on the device (torch's way for storage-less
    backends)."""
    return rebuild_device_tensor_args(t.detach().cpu(), t.dtype, str(t.device), t.requires_grad)


def register_forking_reduction(cls) -> None:
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(cls, forking_reduce)
