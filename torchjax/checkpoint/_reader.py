"""A safetensors file read as NumPy arrays, whole or one slice at a time, any dtype.

Note [Why torchjax parses the safetensors header itself]
The format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end
of the header; an optional ``"__metadata__"`` of str -> str) and the raw little-endian
bytes (https://github.com/huggingface/safetensors#format). safetensors' own non-torch
readers cannot serve us: ``safe_open(framework="numpy")`` rejects BF16 and F8
("data type 'bfloat16' not understood"), and ``framework="flax"`` narrows I64 to int32
(JAX's x64 is off outside torchjax ops) and rejects F8 too (safetensors 0.8). Its torch
reader would make the CPU torch copy we avoid. Reading the header ourselves gives every
dtype exactly (bfloat16 and float8 through ml_dtypes, via torchjax/tensor/dtypes.py), and
slices read only their bytes: a run of whole leading rows is one ``os.pread``; any other
slice is copied out of a memory map of that one tensor (what safetensors' ``get_slice``
does in Rust), which is unmapped right after.

Note [Read buffers go back to the system]
A tensor read for the device passes through one host buffer, dropped once transferred.
Allocated with ``np.empty`` (malloc), the buffers of a model's worth of tensors were
freed into malloc's arenas but not returned to the system: after a
``from_pretrained(device_map="tpu")`` the process kept about 0.2x the model's bytes more
than it held (CPU JAX, a 94M-parameter Llama; bench/host_memory.py), memory that only
``malloc_trim`` would give back. Buffers of 1 MiB and more are anonymous memory maps of
their own (``host_buffer``): dropping one unmaps it, so the process's resident memory
falls back as soon as the transfer is done.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from typing import NamedTuple

import numpy as np
import torch

from torchjax.tensor import dtypes

# safetensors' dtype names (the format's spec) -> torch dtypes; the JAX/NumPy dtype comes
# from torchjax's one torch<->JAX map.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
# Read buffers at least this large are memory maps of their own (Note [Read buffers go
# back to the system]); smaller ones come from malloc, where they are cheap to reuse.
_MAPPED_BUFFER_BYTES = 1 << 20
# A header larger than this is a corrupt file, not a checkpoint (safetensors' own limit).
_MAX_HEADER_BYTES = 100_000_000


class TensorInfo(NamedTuple):
    """Where one tensor lives in a safetensors file.

    ``dtype`` is the torch dtype, ``np_dtype`` its NumPy/ml_dtypes twin, ``shape`` a tuple
    of ints, ``start`` the absolute byte offset of its data in the file, ``nbytes`` its
    size in bytes.
    """

    name: str
    dtype: torch.dtype
    np_dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


class SafetensorsFile:
    """An open safetensors file: its header parsed, its tensors readable as NumPy arrays.

    Reads are thread-safe (``os.pread`` on one descriptor, or a memory map per read), so
    loaders may read several tensors at once from worker threads.

    **Arguments:** ``path`` - a ``.safetensors`` file.

    **Raises:** ``FileNotFoundError`` if it does not exist; ``ValueError`` naming the file
    if the header is not a valid safetensors header or a tensor's bytes lie outside the
    file or do not match its dtype and shape; ``TypeError`` for a dtype torchjax does not
    support (e.g. ``F8_E8M0``, ``F4``).

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._parse_header()
        except BaseException:
            self.close()
            raise

    def _parse_header(self) -> None:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"torchjax.checkpoint: {self.path} is not a safetensors file (header length "
                f"{n}, file size {size} bytes)"
            )
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"torchjax.checkpoint: {self.path} has an unreadable safetensors header: {error}"
            ) from None
        data_start = 8 + n
        self.metadata: dict[str, str] | None = header.pop("__metadata__", None)
        self._infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            kind = entry["dtype"]
            if kind not in _SAFETENSORS_DTYPES:
                raise TypeError(
                    f"torchjax.checkpoint: tensor {name!r} in {self.path} has safetensors "
                    f"dtype {kind}, which torchjax does not support; supported: "
                    f"{sorted(_SAFETENSORS_DTYPES)}"
                )
            dtype = _SAFETENSORS_DTYPES[kind]
            np_dtype = dtypes.to_jax_dtype(dtype)
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
            expected = math.prod(shape) * np_dtype.itemsize
            if end - begin != expected or data_start + end > size or begin < 0:
                raise ValueError(
                    f"torchjax.checkpoint: tensor {name!r} in {self.path} has data_offsets "
                    f"[{begin}, {end}] but dtype {kind} and shape {list(shape)} need "
                    f"{expected} bytes within a file of {size} bytes"
                )
            self._infos[name] = TensorInfo(
                name, dtype, np_dtype, shape, data_start + begin, expected
            )

    # -- header -------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names, in header order."""
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        """The ``TensorInfo`` of ``name``; ``KeyError`` naming the file if absent."""
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(
                f"torchjax.checkpoint: no tensor {name!r} in {self.path} "
                f"({len(self._infos)} tensors)"
            ) from None

    # -- data ---------------------------------------------------------------------
    def read(self, name: str, index=None) -> np.ndarray:
        """Tensor ``name`` (or the part ``index`` selects) as a new, writable NumPy array.

        **Arguments:**
        - ``name``: the tensor's name in the file.
        - ``index``: ``None`` or ``...`` for the whole tensor, else a tuple of ``slice``
          objects (steps allowed) and ints, as ``jax.sharding.Sharding.devices_indices_map``
          gives them; missing trailing axes are whole.

        **Returns:** an array of the selected shape and the tensor's exact dtype (bfloat16
        and float8 as ml_dtypes). Only the selected bytes are read (see the module note).

        **Raises:** ``KeyError`` for an unknown name, ``IndexError`` for an index with
        more axes than the tensor.
        """
        info = self.info(name)
        slices, squeeze = _normalize_index(index, info.shape, name)
        out_shape = tuple(len(range(*s.indices(d))) for s, d in zip(slices, info.shape))
        if math.prod(out_shape) == 0:
            return np.empty(out_shape, info.np_dtype)[squeeze]
        run = _leading_run(slices, info.shape)
        if run is not None:
            row_bytes = info.nbytes // info.shape[0] if info.shape else info.nbytes
            first, rows = run
            out = host_buffer(out_shape, info.np_dtype)
            buffer = memoryview(out.reshape(-1).view(np.uint8))
            _pread_into(self._fd, buffer, info.start + first * row_bytes, self.path)
            return out[squeeze]
        # A strided selection: copy it out of a map of this tensor's bytes only.
        mapped = np.memmap(self.path, info.np_dtype, "r", offset=info.start, shape=info.shape)
        try:
            part = mapped[slices][squeeze]
            out = host_buffer(part.shape, part.dtype)
            np.copyto(out, part)
            return out
        finally:
            del mapped

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def __repr__(self):
        return f"SafetensorsFile({self.path!r}, {len(self._infos)} tensors)"


def host_buffer(shape, dtype) -> np.ndarray:
    """A new writable C-ordered array, in an anonymous memory map of its own when it
    is large (Note [Read buffers go back to the system]): its memory is returned to
    the system when the array (and every view of it) is gone."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MAPPED_BUFFER_BYTES:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def _normalize_index(index, shape, name):
    """(tuple of ``slice`` per axis, the index that drops int-indexed axes)."""
    if index is None or index is Ellipsis:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    if len(index) > len(shape):
        raise IndexError(
            f"torchjax.checkpoint: index {index} has {len(index)} axes but tensor {name!r} "
            f"has shape {list(shape)}"
        )
    slices, squeeze = [], []
    for i, dim in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        if isinstance(i, slice):
            slices.append(i)
            squeeze.append(slice(None))
        else:
            i = int(i)
            if not -dim <= i < dim:
                raise IndexError(
                    f"torchjax.checkpoint: index {i} out of range for an axis of size {dim} "
                    f"in tensor {name!r} of shape {list(shape)}"
                )
            i %= dim
            slices.append(slice(i, i + 1))
            squeeze.append(0)
    return tuple(slices), tuple(squeeze)


def _leading_run(slices, shape):
    """(first row, row count) when ``slices`` select one contiguous run of bytes: a unit-
    step range of axis 0 with every other axis whole; else None."""
    if not shape:
        return 0, 1
    first, stop, step = slices[0].indices(shape[0])
    if step != 1:
        return None
    for s, d in zip(slices[1:], shape[1:]):
        if s.indices(d) != (0, d, 1):
            return None
    return first, stop - first


def _pread_into(fd: int, buffer: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"torchjax.checkpoint: {path} ended while reading (truncated?)")
        done += n
