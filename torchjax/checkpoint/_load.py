"""safetensors -> tpu tensors whose data is a jax.Array read from the file (maybe sharded).

Note [One device's slice at a time]
``jax.make_array_from_callback`` calls its callback for every addressable device and keeps
all the returned host arrays until one batched transfer at the end (jax/_src/array.py), so
a tensor sharded over N devices would sit whole on the host (N times over for a
replicated axis). ``read_array`` instead walks ``sharding.addressable_devices_indices_map``
itself: for each device it reads that device's slice (``SafetensorsFile.read(name,
index)``), transfers it, and drops the host copy before the next read; a slice shared by
several devices (replication) is read once and copied device to device. The pieces become
one array with ``jax.make_array_from_single_device_arrays``. Peak host memory is one
device's slice, and in a multi-process job each process reads only its own devices'
slices.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import jax
import numpy as np
import torch

from torchjax._compat.jax import x64
from torchjax.checkpoint._reader import SafetensorsFile, host_buffer
from torchjax.device._mesh import get_mesh
from torchjax.device._module import jax_device
from torchjax.tensor import dtypes
from torchjax.tensor._fills import host_onto
from torchjax.tensor._tensor import wrap

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# What ``sharding=`` accepts: one sharding for all tensors, a dict by name, or a function
# of the name; a value may be a Sharding, a PartitionSpec (on the active mesh) or None.
ShardingArg = (
    jax.sharding.Sharding
    | Mapping[str, "jax.sharding.Sharding | jax.sharding.PartitionSpec | None"]
    | Callable[[str], "jax.sharding.Sharding | jax.sharding.PartitionSpec | None"]
    | None
)


def read_array(
    file: SafetensorsFile,
    name: str,
    *,
    dtype: torch.dtype | None = None,
    sharding: jax.sharding.Sharding | None = None,
    device: str | int | torch.device = "tpu",
) -> jax.Array:
    """One tensor of an open safetensors file as a jax.Array, read straight from the file.

    **Arguments:**
    - ``file``: an open ``SafetensorsFile``.
    - ``name``: the tensor's name.
    - ``dtype``: a torch floating dtype to cast floating tensors to (on the host, slice by
      slice, rounding to nearest even as torch does); integer, bool and complex tensors
      keep their dtype, as in ``from_pretrained(dtype=...)``. ``None`` keeps the file's.
    - ``sharding``: a ``jax.sharding.Sharding``; each addressable device's slice is read
      on its own (Note [One device's slice at a time]). ``None``: the whole tensor on
      ``device``.
    - ``device``: the tpu device when ``sharding`` is None (``"tpu"``, ``"tpu:1"``, an
      index or a ``torch.device``).

    **Returns:** a jax.Array of the tensor's shape, placed as a tpu tensor's array is
    (without ``sharding``: uncommitted on tpu:0, committed to any other device; Note
    [Uncommitted arrays on tpu:0] in torchjax/tensor/_fills.py); its dtype is the file's
    (bfloat16, float8 and 64-bit dtypes kept) or ``dtype``.

    **Raises:** ``KeyError`` for an unknown name; ``ValueError`` if the sharding does not
    divide the shape as JAX requires (JAX's message names the shapes).
    """
    info = file.info(name)
    target = _target_np_dtype(info.dtype, dtype)

    def read(index=None) -> np.ndarray:
        arr = file.read(name, index)
        if arr.dtype == target:
            return arr
        out = host_buffer(arr.shape, target)  # Note [Read buffers go back to the system]
        np.copyto(out, arr, casting="unsafe")
        return out

    with x64(True):  # int64/float64 stay 64-bit (Note [x64 without touching the user's JAX])
        if sharding is None:
            return host_onto(read(), _jax_device(device))
        pieces, by_index = [], {}
        for dev, index in sharding.addressable_devices_indices_map(info.shape).items():
            key = _index_key(index, info.shape)
            first = by_index.get(key)
            if first is None:
                first = by_index[key] = jax.device_put(read(index), dev)
                pieces.append(first)
            else:  # the same slice on another device: copy device to device, no re-read
                pieces.append(jax.device_put(first, dev))
        return jax.make_array_from_single_device_arrays(info.shape, sharding, pieces)


def load_file(
    path: str | os.PathLike,
    device: str | int | torch.device = "tpu",
    *,
    dtype: torch.dtype | None = None,
    sharding: ShardingArg = None,
    keys=None,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file into tpu tensors, without a torch CPU copy.

    The counterpart of ``safetensors.torch.load_file(path, device=...)``: every tensor's
    bytes go from the file into a jax.Array (one host buffer per tensor or per device
    slice, freed after the transfer) that the returned tpu tensor holds.

    **Arguments:**
    - ``path``: a ``.safetensors`` file.
    - ``device``: the tpu device for unsharded tensors (``"tpu"``, ``"tpu:N"``, index).
    - ``dtype``: cast floating tensors to this torch dtype (see ``read_array``).
    - ``sharding``: where each tensor goes. A ``jax.sharding.Sharding`` (all tensors), a
      dict ``name -> Sharding | PartitionSpec | None`` or a function ``name -> Sharding |
      PartitionSpec | None``. A ``PartitionSpec`` is taken on the active mesh
      (``torchjax.sharding.get_mesh()``). ``None`` (argument or value): replicated over
      the active mesh if one is set, else the whole tensor on ``device``. Sharded
      tensors are read one device slice at a time.
    - ``keys``: read only these names (default: all).

    **Returns:** ``dict[str, torch.Tensor]`` of tpu tensors, in the file's order, each
    with the file's shape and dtype (or ``dtype``); sharded ones carry a NamedSharding
    (``torchjax.to_jax(t).sharding``).

    **Raises:** ``FileNotFoundError``; ``ValueError`` for a malformed file, or a
    PartitionSpec with no active mesh; ``KeyError`` for a name in ``keys`` not in the
    file; ``TypeError`` for an unsupported dtype or ``sharding`` value.
    """
    index = _device_index(device)
    with SafetensorsFile(path) as file:
        names = file.keys() if keys is None else list(keys)
        return {
            name: wrap(
                read_array(
                    file,
                    name,
                    dtype=dtype,
                    sharding=_sharding_for(name, sharding),
                    device=index,
                ),
                index,
            )
            for name in names
        }


def read_index(path: str | os.PathLike) -> dict[str, str]:
    """The tensor -> file map of a Hugging Face checkpoint directory or index file.

    **Arguments:** ``path`` - a directory holding ``model.safetensors.index.json`` (HF's
    sharded layout) or ``model.safetensors``, or the index json, or one ``.safetensors``
    file.

    **Returns:** ``{tensor name: absolute path of the file holding it}``.

    **Raises:** ``FileNotFoundError`` if the directory has neither file; ``ValueError``
    for an index without a ``weight_map``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        index_path = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
        if not os.path.exists(index_path):
            single = os.path.join(path, SAFE_WEIGHTS_NAME)
            if not os.path.exists(single):
                raise FileNotFoundError(
                    f"torchjax.checkpoint: {path} holds neither {SAFE_WEIGHTS_INDEX_NAME} nor "
                    f"{SAFE_WEIGHTS_NAME}"
                )
            path = single
        else:
            path = index_path
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"torchjax.checkpoint: {path} has no 'weight_map' object")
        folder = os.path.dirname(os.path.abspath(path))
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    with SafetensorsFile(path) as file:
        return dict.fromkeys(file.keys(), os.path.abspath(path))


def load(
    path: str | os.PathLike,
    device: str | int | torch.device = "tpu",
    *,
    dtype: torch.dtype | None = None,
    sharding: ShardingArg = None,
) -> dict[str, torch.Tensor]:
    """``load_file`` for a file, a Hugging Face checkpoint directory or its index json.

    A directory with ``model.safetensors.index.json`` is read file by file (each file
    opened once); one with ``model.safetensors`` is that file. Arguments, returns and
    errors as ``load_file`` and ``read_index``.
    """
    by_file: dict[str, list[str]] = {}
    for name, file in read_index(path).items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        out.update(load_file(file, device, dtype=dtype, sharding=sharding, keys=names))
    return out


# -- helpers ------------------------------------------------------------------------------
def _target_np_dtype(file_dtype: torch.dtype, dtype: torch.dtype | None) -> np.dtype:
    if dtype is not None and file_dtype.is_floating_point:
        if not dtype.is_floating_point:
            raise TypeError(
                f"torchjax.checkpoint: dtype= casts floating tensors and must be a floating "
                f"dtype, got {dtype}"
            )
        return dtypes.to_jax_dtype(dtype)
    return dtypes.to_jax_dtype(file_dtype)


def _device_index(device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(
            f"torchjax.checkpoint reads into tpu tensors, got device={device}; use "
            "safetensors.torch.load_file for CPU tensors"
        )
    return device.index or 0


def _jax_device(device) -> jax.Device:
    return jax_device(_device_index(device))


def _sharding_for(name: str, sharding: ShardingArg) -> jax.sharding.Sharding | None:
    """The jax Sharding for tensor ``name`` under a ``load_file(sharding=...)`` argument."""
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if sharding is None:
        value = None
    elif isinstance(sharding, Mapping):
        value = sharding.get(name)
    elif callable(sharding):
        value = sharding(name)
    else:
        raise TypeError(
            "torchjax.checkpoint: sharding= takes a jax.sharding.Sharding, a dict or a "
            f"function of the tensor name, got {type(sharding).__name__}"
        )
    if isinstance(value, jax.sharding.Sharding):
        return value
    if value is not None and not isinstance(value, jax.sharding.PartitionSpec):
        raise TypeError(
            f"torchjax.checkpoint: the sharding for {name!r} must be a jax.sharding.Sharding, "
            f"a PartitionSpec or None, got {type(value).__name__}"
        )
    mesh = get_mesh()
    if mesh is None:
        if value is not None:
            raise ValueError(
                f"torchjax.checkpoint: tensor {name!r} was given PartitionSpec {value} but no "
                "mesh is active; enter `with torchjax.sharding.mesh(...)` or pass a "
                "NamedSharding"
            )
        return None
    return jax.sharding.NamedSharding(mesh, value or jax.sharding.PartitionSpec())


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(d) for s, d in zip(index, shape))
