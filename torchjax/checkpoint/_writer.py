"""A safetensors file written one tensor at a time.

Note [Streaming safetensors writes]
safetensors' writers (``serialize_file`` behind ``safetensors.torch.save_file`` and
``numpy``) take a pointer to every tensor's bytes at once, so a model saved from tpu
had to sit whole on the host first: ``save_pretrained`` of a 4B bf16 model built on
tpu peaked at 3.9x its 8 GB of weights. The format needs only each tensor's dtype and
shape up front (its header: name -> dtype, shape, byte range), so ``write`` writes the
header from those, then fetches each tensor's bytes from the device, writes them and
drops them before the next: the host holds one tensor (plus its device-to-host copy,
which ``fetch`` makes) at a time.

The file is byte for byte what safetensors writes for the same values: the tensors'
order is safetensors' own (asked of ``safetensors.serialize`` with an empty entry per
name, so a release that orders them differently is followed, not guessed), the header
is the same compact JSON with ``__metadata__`` first, padded with spaces to a multiple
of 8 bytes (tests/checkpoint/test_save.py compares whole files). Where the metadata has
several keys, safetensors writes them in its hash map's order, which differs run to
run; here they keep the dict's order. Little-endian hosts only, as the bytes are
written as they are in memory.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping

import numpy as np
import safetensors
import torch

from torchjax.checkpoint._reader import _SAFETENSORS_DTYPES

_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names in the order safetensors lays their data out (by dtype, then name)."""
    anchor = np.zeros(1, np.uint8)  # a valid pointer for entries of no bytes
    specs = {
        name: safetensors.TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=[0],
            data_ptr=anchor.ctypes.data,
            data_len=0,
        )
        for name, t in tensors.items()
    }
    out = safetensors.serialize(specs)
    n = int.from_bytes(out[:8], "little")
    header = json.loads(out[8 : 8 + n])
    header.pop("__metadata__", None)
    return list(header)


def header_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    """(the 8-byte length and padded JSON header of a file of ``tensors``, their order)."""
    order = _order(tensors)
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    begin = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise TypeError(
                f"torchjax.checkpoint.save_file: {name!r} has dtype {t.dtype}, which "
                f"safetensors cannot store; supported: {sorted(map(str, _NAMES))}"
            )
        end = begin + math.prod(t.shape) * t.element_size()
        entry = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [begin, end]}
        header[name] = entry
        begin = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def write(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None,
    fetch: Callable[[torch.Tensor], np.ndarray],
) -> None:
    """Write ``tensors`` to ``path`` as safetensors, one at a time (see the Note).

    ``fetch(t)`` gives a tensor's values as a C-ordered host array of its dtype and
    shape; it is called once per tensor, in file order, and its result dropped after
    the write.
    """
    head, order = header_bytes(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            t = tensors[name]
            arr = fetch(t)
            want = math.prod(t.shape) * t.element_size()
            if arr.nbytes != want:
                raise RuntimeError(
                    f"torchjax.checkpoint: {name!r} gave {arr.nbytes} bytes for dtype "
                    f"{t.dtype} and shape {list(t.shape)} ({want} expected)"
                )
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
            del arr
