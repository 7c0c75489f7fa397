"""``from_pretrained(..., device_map="tpu")`` reads safetensors straight into jax arrays;
``save_pretrained`` works on tpu models.

Note [Patching transformers' loading and saving]
transformers 5 has no documented hook for a device's tensor reader, so two of its
functions are wrapped, each marked with ``__torchjax_patch__`` and checked by
tests/integrations/test_loading.py against the transformers version they were written
for (an upgrade that moves them fails that test loudly):

1. ``PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files,
   load_config, ...)`` (modeling_utils.py). Without us it opens each file with
   ``safe_open(framework="pt")`` and hands ``convert_and_load_state_dict_in_model`` lazy
   slices; each is materialised as a CPU torch tensor (``tensor[...]``) and then copied
   with ``.to("tpu", dtype)`` (core_model_loading.py ``_materialize_copy``). When every
   device of the device map is a tpu and nothing else (quantizer, DeepSpeed, TP mesh,
   disk offload) is in play, the wrapper passes ``state_dict=`` a dict of
   ``_TpuSlice``: the same lazy-slice protocol (``[...]``, ``get_shape``, ``get_dtype``)
   answered by torchjax.checkpoint, so ``tensor[...]`` is a tpu tensor read from the file
   into a jax.Array, and the ``.to`` that follows is a no-op (or a device-side cast for
   ``dtype=``). transformers' own renaming, conversion ops, dtype plan and weight tying
   run unchanged.
2. ``modeling_utils.safe_save_file``: ``save_pretrained`` writes each shard with it
   (``safetensors.torch.save_file``, bound when modeling_utils is imported). Wrapped as
   safetensors' own (Note [safetensors' save_file of tpu tensors] in
   torchjax/integrations/_safetensors.py): a shard of tpu tensors is written one tensor
   at a time, straight from the device, so a save holds one tensor on the host rather
   than a CPU copy of the model (the earlier way: ``remove_tied_weights_from_state_dict``
   wrapped to copy the state dict to CPU, 3.9x the weights at the peak). Everything
   before the write is transformers' own on the tpu tensors: tied weights are found by
   storage pointer (tpu storages have the root's address: Note [torch storages of tpu
   tensors] in torchjax/tensor/_addresses.py), and the renaming, dedup, sharding and
   index are as for a CPU model. For the sharding, huggingface_hub's
   ``get_torch_storage_size`` and ``get_torch_storage_id``
   (``huggingface_hub.serialization._torch``, which ``split_torch_state_dict_into_shards``
   calls through its module) are wrapped too: they read a wrapper subclass through its
   inner tensors, a tpu tensor's data-less stand-in (0 bytes, no address), so a whole
   model went to one shard, and tensors of equal size counted as sharing storage. A tpu
   tensor is answered from its own storage (address and size), as a CPU tensor is.

3. ``PreTrainedModel.from_pretrained``: a tensor-parallel load on "tpu" -
   ``from_pretrained(path, device_map="tpu", tp_plan="auto", tp_size=4)``, or
   ``distributed_config=DistributedConfig(tp_plan=..., tp_size=...)``, or
   ``distributed_config=torchjax.sharding.TensorParallelConfig(...)`` - goes to
   ``torchjax.sharding.load_pretrained``, which reads every device's block of every weight
   straight into a ``NamedSharding`` over the active ``torchjax.mesh`` (or the first
   ``tp_size`` devices). transformers' own TP path needs ``torch.distributed`` with one
   process per device; under JAX one process drives all its devices.

Each wrapper keeps the wrapped function's public face (``functools.wraps``: name, docstring,
``inspect.signature`` through ``__wrapped__``) and takes ``*args, **kwargs``, binding them to
the original's signature to read what it needs and forwarding them unchanged: every call
form transformers accepts (``from_pretrained(pretrained_model_name_or_path=...)``,
``save_pretrained(save_directory=...)``) still works, with transformers' own errors, and
CPU code sees the same results with or without ``import torchjax`` (a test runs both).

``install()`` applies all three; ``install_when_imported()`` (called by ``import torchjax``)
applies them once ``transformers.modeling_utils`` is imported, so ``import torchjax``
never imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from torchjax.integrations import _after_import

# The transformers release the patches were written against (checked by a test).
PATCHED_FOR = "5.24"
_TARGET_MODULE = "transformers.modeling_utils"


class _TpuSlice:
    """One checkpoint tensor, read to tpu on indexing (safetensors' ``PySafeSlice`` API)."""

    __slots__ = ("_file", "_name", "_device")

    def __init__(self, file, name: str, device: int):
        self._file, self._name, self._device = file, name, device

    def get_shape(self) -> list[int]:
        return list(self._file.info(self._name).shape)

    def get_dtype(self) -> str:
        from torchjax.checkpoint._reader import _SAFETENSORS_DTYPES

        dtype = self._file.info(self._name).dtype
        return next(k for k, v in _SAFETENSORS_DTYPES.items() if v == dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        from torchjax._compat.jax import x64
        from torchjax.device._module import jax_device
        from torchjax.tensor._fills import host_onto
        from torchjax.tensor._tensor import wrap

        # Only the bytes of the part asked for are read (all of them for `[...]`).
        part = self._file.read(self._name, index)
        with x64(True):  # int64 stays int64 (Note [x64 without touching the user's JAX])
            # Placed as tpu tensors are (Note [Uncommitted arrays on tpu:0]).
            arr = host_onto(part, jax_device(self._device))
        return wrap(arr, self._device)


def _tpu_index(device) -> int | None:
    """The tpu index of a device-map value, or None if it is not a tpu."""
    if isinstance(device, (str, torch.device)):
        try:
            device = torch.device(device)
        except RuntimeError:  # "disk" and other non-devices
            return None
        return (device.index or 0) if device.type == "tpu" else None
    return None


def fast_path_device(checkpoint_files, load_config) -> int | None:
    """The tpu index the fast path reads to, or None when transformers must load itself.

    Taken when: safetensors files, a device map whose every value is the same tpu
    device, no quantizer, no TP/device mesh, no DeepSpeed ZeRO-3, no disk offload.
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    if load_config.hf_quantizer is not None or load_config.device_mesh is not None:
        return None
    if is_deepspeed_zero3_enabled() or not load_config.device_map:
        return None
    indices = {_tpu_index(d) for d in load_config.device_map.values()}
    if len(indices) != 1 or None in indices:
        return None
    return indices.pop()


def _patched(original, wrapper):
    """``wrapper`` dressed as ``original``: same name, docstring and ``inspect.signature``
    (through ``__wrapped__``), marked with ``__torchjax_patch__``. Wrappers take
    ``*args, **kwargs`` and forward them unchanged, so every call form transformers
    accepts (positional or keyword) is still accepted, with transformers' own errors."""
    functools.wraps(original)(wrapper)
    wrapper.__torchjax_patch__ = original
    return wrapper


def _wrap_load_pretrained_model(original):
    signature = inspect.signature(original)

    def _load_pretrained_model(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # transformers' own error
        state_dict, checkpoint_files, load_config = (
            bound.arguments[k] for k in ("state_dict", "checkpoint_files", "load_config")
        )
        device = None if state_dict is not None else fast_path_device(checkpoint_files, load_config)
        if device is None:
            return original(*args, **kwargs)
        from torchjax.checkpoint import SafetensorsFile

        files = [SafetensorsFile(path) for path in checkpoint_files]
        try:
            bound.arguments["state_dict"] = {
                name: _TpuSlice(f, name, device) for f in files for name in f.keys()
            }
            return original(*bound.args, **bound.kwargs)
        finally:
            for f in files:
                f.close()

    return staticmethod(_patched(original, _load_pretrained_model))


def tensor_parallel_config(kwargs: dict):
    """The ``TensorParallelConfig`` a ``from_pretrained`` call asks for (popping the TP
    arguments from ``kwargs``), or None when it is not a tensor-parallel load on tpu."""
    from torchjax.sharding import TensorParallelConfig

    dc = kwargs.get("distributed_config")
    if isinstance(dc, TensorParallelConfig):
        del kwargs["distributed_config"]
        return dc
    if _tpu_index(kwargs.get("device_map")) is None:
        return None
    plan, size = kwargs.get("tp_plan"), kwargs.get("tp_size")
    if dc is not None and getattr(dc, "tp_plan", None) is not None:
        plan, size = dc.tp_plan, getattr(dc, "tp_size", None) or size
    if plan is None:
        return None
    for key in ("distributed_config", "tp_plan", "tp_size", "device_map"):
        kwargs.pop(key, None)
    return TensorParallelConfig(plan=plan, tp_size=size)


def _wrap_from_pretrained(original):
    function = original.__func__

    def from_pretrained(cls, *args, **kwargs):
        tp = tensor_parallel_config(kwargs)
        if tp is None:
            return function(cls, *args, **kwargs)
        if "pretrained_model_name_or_path" in kwargs and not args:
            args = (kwargs.pop("pretrained_model_name_or_path"),)
        if len(args) != 1:
            raise TypeError(
                "torchjax: a tensor-parallel from_pretrained on tpu takes the path and then "
                f"keyword arguments only (got {len(args)} positional arguments)"
            )
        from torchjax.sharding._load import load_sharded

        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        dtype = None if dtype == "auto" else dtype
        return load_sharded(cls, args[0], tp, dtype=dtype, caller="from_pretrained", **kwargs)

    _patched(function, from_pretrained)
    from_pretrained.__torchjax_patch__ = original
    return classmethod(from_pretrained)


def tpu_state_dict_to_cpu(state_dict: dict) -> dict:
    """``state_dict`` with tpu tensors copied to CPU, sharing kept: tensors that share a
    tpu Storage become views of one CPU tensor (same size, stride and offset), so
    pointer-based tied-weight detection sees them as shared. Other values are kept.
    (accelerate's checkpoint saving uses it: Note [accelerate's safetensors save of tpu
    tensors] in torchjax/integrations/accelerate/_saving.py.)"""
    from torchjax.ops.copy import to_cpu
    from torchjax.tensor import dtypes
    from torchjax.tensor._tensor import JaxTensor, wrap

    bases: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state_dict.items():
        if not isinstance(t, JaxTensor):
            out[name] = t
            continue
        storage = t._storage
        if dtypes.to_jax_dtype(t.dtype) != storage.arr.dtype:
            out[name] = t.detach().cpu()  # a dtype view: no common CPU storage to share
            continue
        base = bases.get(id(storage))
        if base is None:
            base = bases[id(storage)] = to_cpu(wrap(storage.arr)).reshape(-1)
        out[name] = base.as_strided(t._size, t._stride, t._offset)
    return out


def _wrap_storage_size(original):
    def get_torch_storage_size(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
            return tensor.untyped_storage().nbytes()
        return original(tensor)

    return _patched(original, get_torch_storage_size)


def _wrap_storage_id(original):
    def get_torch_storage_id(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
            storage = tensor.untyped_storage()
            return tensor.device, storage.data_ptr(), storage.nbytes()
        return original(tensor)

    return _patched(original, get_torch_storage_id)


_HUB_WRAPPERS = {
    "get_torch_storage_size": _wrap_storage_size,
    "get_torch_storage_id": _wrap_storage_id,
}


def install() -> None:
    """Apply the patches of Note [Patching transformers' loading and saving] (idempotent)."""
    from transformers import modeling_utils

    cls = modeling_utils.PreTrainedModel
    if not hasattr(cls._load_pretrained_model, "__torchjax_patch__"):
        cls._load_pretrained_model = _wrap_load_pretrained_model(cls._load_pretrained_model)
    if not hasattr(modeling_utils.safe_save_file, "__torchjax_patch__"):
        from torchjax.integrations._safetensors import wrap_save_file

        modeling_utils.safe_save_file = wrap_save_file(modeling_utils.safe_save_file)
    from huggingface_hub.serialization import _torch as hub_torch

    for name, wrap in _HUB_WRAPPERS.items():
        if not hasattr(getattr(hub_torch, name), "__torchjax_patch__"):
            setattr(hub_torch, name, wrap(getattr(hub_torch, name)))
    if not hasattr(cls.from_pretrained, "__torchjax_patch__"):
        cls.from_pretrained = _wrap_from_pretrained(cls.__dict__["from_pretrained"])


def uninstall() -> None:
    """Undo ``install()`` (for tests comparing with transformers' own path)."""
    modeling_utils = sys.modules.get(_TARGET_MODULE)
    if modeling_utils is None:
        return
    cls = modeling_utils.PreTrainedModel
    original = getattr(cls._load_pretrained_model, "__torchjax_patch__", None)
    if original is not None:
        cls._load_pretrained_model = staticmethod(original)
    original = getattr(modeling_utils.safe_save_file, "__torchjax_patch__", None)
    if original is not None:
        modeling_utils.safe_save_file = original
    hub_torch = sys.modules.get("huggingface_hub.serialization._torch")
    for name in _HUB_WRAPPERS:
        original = getattr(getattr(hub_torch, name, None), "__torchjax_patch__", None)
        if original is not None:
            setattr(hub_torch, name, original)
    original = getattr(cls.from_pretrained, "__torchjax_patch__", None)
    if original is not None:
        cls.from_pretrained = original


def install_when_imported() -> None:
    """``install()`` now if transformers' modeling_utils is loaded, else right after it is."""
    if _TARGET_MODULE in sys.modules:
        install()
    elif not _after_import.hooks_for(_TARGET_MODULE):
        sys.meta_path.insert(0, _after_import.InstallAfterImport(_TARGET_MODULE, install))
