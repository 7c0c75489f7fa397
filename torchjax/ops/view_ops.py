"""View ops: results alias ``self``'s storage (see Note [Aliasing through views]).

Each lowering here only computes the view's value with jnp; the registry runs the same op
on a meta tensor for the sizes/strides/offset and makes the result share ``self``'s
storage, so a later in-place write through either is seen by both. ``reshape``,
``narrow``, ``flatten``, ``unflatten``, ``movedim``, ``chunk``, ``tensor_split``,
``expand_as``, ``view_as`` are CompositeImplicitAutograd in ATen and reach the ops below.

``view.dtype``, ``view_as_real`` and ``view_as_complex`` (and through them ``.real`` and
``.imag``) reinterpret the element type; they alias too, through an interpretation of
the storage (Note [Views across dtypes] in torchjax/tensor/_reinterpret.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops.registry import handler, lowering
from torchjax.tensor._tensor import view_of

aten = torch.ops.aten


def _dim(dim: int, ndim: int, op: str) -> int:
    """Wrap a possibly negative ``dim`` like ATen's maybe_wrap_dim (0-d acts as 1-d)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got "
            f"{dim}) (in aten::{op})"
        )
    return dim % n


@lowering(aten.view.default, aten._reshape_alias.default)
def view(self, size, stride=None):
    """aten::view / _reshape_alias - the same elements in a new shape (one -1 inferred).

    Shapes: numel(size) == numel(self); torch's stride compatibility check runs on the
    meta tensor. Dtypes: unchanged. Reference: torch.Tensor.view.
    """
    return jnp.reshape(self, tuple(int(s) for s in size))


@lowering(aten.view.dtype)
def view_dtype(self, dtype):
    """aten::view.dtype - the same bytes read as ``dtype``; an alias, like every view.

    Shapes: equal itemsize keeps the shape; otherwise the last dim scales by the ratio.
    torch's checks (last-dim stride 1, size and storage-offset divisibility, no conj
    bit) run on the meta tensor with torch's messages. The value is read lazily through
    the storage (Note [Views across dtypes] in torchjax/tensor/_reinterpret.py), so this
    body is never called. Reference: torch.Tensor.view(dtype).
    """
    raise AssertionError("aten::view.dtype is a layout view (Note [Lazy views])")


@lowering(aten.permute.default)
def permute(self, dims):
    """aten::permute - reorder dimensions. Reference: torch.permute."""
    return jnp.transpose(self, tuple(_dim(d, self.ndim, "permute") for d in dims))


@lowering(aten.transpose.int)
def transpose(self, dim0, dim1):
    """aten::transpose.int - swap two dimensions (0-d/1-d: identity)."""
    if self.ndim < 2:
        _dim(dim0, self.ndim, "transpose"), _dim(dim1, self.ndim, "transpose")
        return self
    return jnp.swapaxes(self, dim0, dim1)


@lowering(aten.t.default)
def t(self):
    """aten::t - transpose a <= 2-d tensor (0-d/1-d: identity)."""
    if self.ndim > 2:
        raise RuntimeError(
            f"t() expects a tensor with <= 2 dimensions, but self is {self.ndim}D (in aten::t)"
        )
    return self.T if self.ndim == 2 else self


@lowering(aten.expand.default)
def expand(self, size, implicit=False):
    """aten::expand - broadcast to ``size`` (-1 keeps a dim; new dims lead). Stride 0."""
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@lowering(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(self, dim=None):
    """aten::squeeze - drop size-1 dims (all, one, or a list); a non-1 dim is kept."""
    if dim is None:
        return jnp.squeeze(self)
    if self.ndim == 0:
        return self
    dims = [dim] if isinstance(dim, int) else list(dim)
    dims = {_dim(d, self.ndim, "squeeze") for d in dims}
    return jnp.squeeze(self, tuple(d for d in dims if self.shape[d] == 1))


@lowering(aten.unsqueeze.default)
def unsqueeze(self, dim):
    """aten::unsqueeze - insert a size-1 dim at ``dim`` (in [-ndim-1, ndim])."""
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1, "unsqueeze"))


def _slice_bounds(n, start, end, step):
    if step <= 0:
        raise RuntimeError(f"slice step must be positive, got {step} (in aten::slice)")
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end


@lowering(aten.slice.Tensor)
def slice(self, dim=0, start=None, end=None, step=1):
    """aten::slice.Tensor - ``self[..., start:end:step]`` on ``dim`` (bounds clamped)."""
    dim = _dim(dim, self.ndim, "slice")
    start, end = _slice_bounds(self.shape[dim], start, end, step)
    return lax.slice_in_dim(self, start, end, step, axis=dim)


@lowering(aten.select.int)
def select(self, dim, index):
    """aten::select.int - drop ``dim`` at ``index`` (negative wraps). IndexError if out."""
    if self.ndim == 0:
        raise IndexError("select() cannot be applied to a 0-dim tensor. (in aten::select)")
    dim = _dim(dim, self.ndim, "select")
    n = self.shape[dim]
    if not -n <= index < n:
        raise IndexError(
            f"select(): index {index} out of range for tensor of size "
            f"{list(self.shape)} at dimension {dim} (in aten::select.int)"
        )
    return lax.index_in_dim(self, index % n, axis=dim, keepdims=False)


@lowering(aten.split.Tensor, aten.split_with_sizes.default, aten.split_copy.Tensor)
def split(self, split_size, dim=0):
    """aten::split.Tensor / split_with_sizes - consecutive pieces along ``dim``.

    An int gives pieces of that size (the last may be smaller); a list gives the sizes.
    ``split_copy`` (and through it ``split_copy.Tensor_out``) gives the same pieces as new
    tensors: it has no decomposition in torch's table.
    """
    dim = _dim(dim, self.ndim, "split")
    n = self.shape[dim]
    if isinstance(split_size, int):
        sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
        if n == 0:
            sizes = [0]
    else:
        sizes = list(split_size)
        if sum(sizes) != n:
            raise RuntimeError(
                f"split_with_sizes expects split_sizes to sum exactly to {n} "
                f"(input tensor's size at dimension {dim}), but got "
                f"split_sizes={sizes} (in aten::split_with_sizes)"
            )
    out, pos = [], 0
    for s in sizes:
        out.append(lax.slice_in_dim(self, pos, pos + s, axis=dim))
        pos += s
    return out


@lowering(aten.unbind.int)
def unbind(self, dim=0):
    """aten::unbind.int - every index along ``dim``, that dim removed."""
    dim = _dim(dim, self.ndim, "unbind")
    return [lax.index_in_dim(self, i, axis=dim, keepdims=False) for i in range(self.shape[dim])]


@lowering(aten.diagonal.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    """aten::diagonal - the ``offset`` diagonal of (dim1, dim2), appended as the last dim."""
    return jnp.diagonal(
        self, offset, _dim(dim1, self.ndim, "diagonal"), _dim(dim2, self.ndim, "diagonal")
    )


@lowering(aten.unfold.default)
def unfold(self, dimension, size, step):
    """aten::unfold - windows of ``size`` every ``step`` along ``dimension``.

    Shapes: ``dimension`` becomes (size - size) // step + 1 windows, a new last dim of
    ``size``. 0-d: treated as 1-d of one element. Reference: torch.Tensor.unfold.
    """
    arr = self.reshape(1) if self.ndim == 0 else self
    dim = _dim(dimension, arr.ndim, "unfold")
    n = arr.shape[dim]
    if size > n:
        raise RuntimeError(
            f"maximum size for tensor at dimension {dim} is {n} but size is "
            f"{size} (in aten::unfold)"
        )
    count = (n - size) // step + 1
    idx = (np.arange(count)[:, None] * step + np.arange(size)[None, :]).astype(np.int64)
    out = jnp.moveaxis(jnp.take(arr, idx, axis=dim), dim + 1, -1)
    return out.reshape(size) if self.ndim == 0 else out


@handler(aten.as_strided.default)
def as_strided(args, kwargs):
    """aten::as_strided - any (size, stride, offset) view of ``self``'s storage.

    Read straight from the storage's flat buffer (Note [Aliasing through views]); an
    overlapping view reads fine but writing into it raises like torch.
    """
    self, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    offset = self._offset if offset is None else int(offset)
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    need = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if min(size, default=1) > 0 and need > self._storage.numel:
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset "
            f"{offset} require a storage of {need} elements, but the storage has "
            f"{self._storage.numel} (in aten::as_strided)"
        )
    return view_of(self, size, stride, offset)


@lowering(aten.view_as_real.default, aten.view_as_complex.default)
def view_as_real(self):
    """aten::view_as_real / view_as_complex - complex (...) <-> real (..., 2), aliasing
    ``self`` (the storage read as the other dtype, Note [Views across dtypes]).

    torch's checks (no conj bit; last dim of size 2 and stride 1, even strides and
    offset) run on the meta tensor; the value is read lazily, so this body is never
    called. float16 -> complex32 is refused: jax has no complex32.
    """
    raise AssertionError("aten::view_as_real is a layout view (Note [Lazy views])")
