"""tpu tensors (sharded or not) -> ordinary safetensors files, and back into a module.

Files are written one tensor at a time (Note [Streaming safetensors writes] in
torchjax/checkpoint/_writer.py): each tensor is gathered to one host NumPy array (a
sharded array is assembled from its device pieces; across processes with
``multihost_utils.process_allgather``), written and dropped before the next, so host
memory holds one tensor, and the file is byte-for-byte what ``safetensors.torch.
save_file`` writes from the same values on CPU.

Shared storage follows safetensors.torch: ``save_file`` refuses tensors that share memory
(a tied ``lm_head.weight``/``embed_tokens.weight``), ``save_model`` keeps one name per
storage and records each dropped name in the metadata (``{dropped: kept}``), and
``load_model`` loads such a file into a model whose tied parameters stay the same
Parameter objects.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from torchjax._compat.jax import host_copy
from torchjax.checkpoint import _writer
from torchjax.checkpoint._load import load_file
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor


def save_file(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write tensors (tpu or CPU) to a safetensors file, as ``safetensors.torch.save_file``.

    **Arguments:**
    - ``tensors``: ``{name: tensor}``; tpu tensors may be sharded (gathered on write)
      or views (their elements are written). Any dtype torchjax supports, bfloat16 and
      float8 included.
    - ``path``: the file to write (overwritten).
    - ``metadata``: optional ``{str: str}`` stored in the header's ``__metadata__``.

    **Raises:** ``TypeError`` if a value is not a tensor or a metadata value not a str;
    ``RuntimeError`` if tensors share storage (tied weights): save one of them, or use
    ``save_model`` which drops the duplicates and records them in the metadata.
    """
    if not isinstance(tensors, dict):
        raise TypeError(
            f"torchjax.checkpoint.save_file expects a dict, got {type(tensors).__name__}"
        )
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"torchjax.checkpoint.save_file: {name!r} is a {type(t).__name__}, not a tensor"
            )
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise TypeError("torchjax.checkpoint.save_file: metadata values must be str")
    shared = [names for names in _storage_groups(tensors) if len(names) > 1]
    if shared:
        raise RuntimeError(
            f"torchjax.checkpoint.save_file: some tensors share memory: {shared}. Saving them "
            "would duplicate them on disk and untie them on load. Save one name per group, "
            "or use torchjax.checkpoint.save_model(model, path), which keeps one and records "
            "the others in the metadata (see https://huggingface.co/docs/safetensors/"
            "torch_shared_tensors)."
        )
    _writer.write(path, tensors, metadata, to_numpy)


def save_model(
    model: torch.nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Save ``model.state_dict()`` with tied tensors stored once (``safetensors.torch.
    save_model`` for tpu models).

    Of each group of state-dict entries sharing a storage the first name in sorted order
    is written (safetensors' rule) and every other one is recorded as
    ``metadata[dropped] = kept``; ``load_model`` reads it back into tied parameters.

    **Raises:** ``RuntimeError`` if tensors overlap in a storage without one covering it
    all (partial views: save them separately).
    """
    state = model.state_dict()
    metadata = dict(metadata or {})
    for names in _storage_groups(state):
        if len(names) < 2:
            continue
        complete = sorted(n for n in names if _covers_storage(state[n]))
        if not complete:
            raise RuntimeError(
                f"torchjax.checkpoint.save_model: {sorted(names)} share a storage but none "
                "covers all of it; save them with save_file after .clone()"
            )
        kept = complete[0]
        for name in sorted(names):
            if name != kept:
                metadata.setdefault(name, kept)
                del state[name]
    save_file(state, path, metadata=metadata or None)


def load_model(
    model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = True, device="tpu"
) -> tuple[list[str], list[str]]:
    """Load a safetensors file into ``model``'s parameters and buffers on tpu, in place.

    Each parameter keeps its Python object (its data is swapped with
    ``torch.utils.swap_tensors``), so tied parameters stay tied; names the file records
    as dropped duplicates (``save_model``'s metadata) are not missing.

    **Returns:** ``(missing, unexpected)`` names, as ``nn.Module.load_state_dict``.

    **Raises:** ``RuntimeError`` listing them if ``strict`` and either is non-empty, or
    if a tensor's shape differs from the model's.
    """
    loaded = load_file(path, device)
    from torchjax.checkpoint._reader import SafetensorsFile

    with SafetensorsFile(path) as file:
        aliases = file.metadata or {}
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    # Non-persistent buffers (rotary inv_freq) are not in state_dict(), so neither in the
    # file save_model wrote: they are not missing, as for load_state_dict.
    persistent = set(model.state_dict(keep_vars=True))
    missing = [
        n for n in named if n in persistent and n not in loaded and aliases.get(n) not in loaded
    ]
    unexpected = [n for n in loaded if n not in named]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"torchjax.checkpoint.load_model: missing keys {missing}, unexpected keys "
            f"{unexpected} in {os.fspath(path)} (strict=False loads the others)"
        )
    done: set[int] = set()
    for name, t in named.items():
        source = loaded.get(name, loaded.get(aliases.get(name, "")))
        if source is None or id(t) in done:
            continue
        if tuple(source.shape) != tuple(t.shape):
            raise RuntimeError(
                f"torchjax.checkpoint.load_model: {name!r} has shape {list(source.shape)} in "
                f"the file but {list(t.shape)} in the model"
            )
        done.add(id(t))
        if isinstance(t, torch.nn.Parameter):
            source = torch.nn.Parameter(source.to(t.dtype), requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, source)
    return missing, unexpected


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host NumPy copy of a tpu or CPU tensor, dtype exact, gathered if sharded."""
    if not isinstance(t, JaxTensor):
        return dtypes.cpu_tensor_to_numpy(t)
    arr = t._value_uncached()  # one view at a time: no copy of each kept by its view
    if not arr.is_fully_addressable:
        # A multi-process array: every process takes part, each gets the whole value.
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    # No host copy left held by the array (a model saved on the chip kept 1.0x its size).
    return np.asarray(host_copy(arr), order="C")  # ascontiguousarray would make 0-d 1-d


def _storage_groups(tensors: dict[str, torch.Tensor]) -> list[set[str]]:
    """Names grouped by the storage they share (tpu: the Storage object; CPU: its pointer)."""
    groups: dict[tuple, set[str]] = {}
    for name, t in tensors.items():
        if isinstance(t, JaxTensor):
            key = ("tpu", id(t._storage))
        elif t.device.type == "meta" or t.numel() == 0:
            key = ("unshared", name)
        else:
            key = (str(t.device), t.untyped_storage().data_ptr())
        groups.setdefault(key, set()).add(name)
    return list(groups.values())


def _covers_storage(t: torch.Tensor) -> bool:
    if isinstance(t, JaxTensor):
        return t._storage.covers(t._size, t._stride, t._offset)
    return t.data_ptr() == t.untyped_storage().data_ptr() and (
        t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )
