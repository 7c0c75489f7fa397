"""``nn.TransformerEncoder``'s nested-tensor path on tpu: ``_nested_tensor_from_mask``,
its left-alignment test, and the padded tensor that stands in for the nested one.

Note [TransformerEncoder's nested path on tpu]
In ``eval()`` without grad, ``nn.TransformerEncoder`` (``enable_nested_tensor=True``, the
default; its first layer eligible for the fused path: ``norm_first=False``,
``batch_first=True``, ...) given a ``src_key_padding_mask`` whose rows are all prefixes
of kept positions (``_nested_tensor_from_mask_left_aligned``) packs the batch into a
nested tensor (``_nested_tensor_from_mask``), runs each layer's
``_transformer_encoder_layer_fwd`` on it without a mask, and unpacks it with
``to_padded_tensor(0.0, src.size())``: every padded position of the result is 0 (its
final norm of 0 where the encoder has one), and a row with no kept position is all 0
instead of the NaN that attention over no key gives. A mask with no kept position at
all is refused by ``to_padded_tensor`` ("at least one constituent tensor should have
non-zero numel").

tpu holds strided tensors only (Note [Unsupported layouts] in
torchjax/device/_layouts.py), so ``_nested_tensor_from_mask`` returns a
``PaddedNested``: the input, still (N, L, D), with each row's length in the nested
tensor and the keys each row attends to. It answers the ops the encoder and its layers
apply to a nested tensor, each through the dense lowering:

- ``_transformer_encoder_layer_fwd`` and ``_native_multi_head_attention`` (without
  weights) with the positions past a row's length masked as keys (mask type 1): each
  kept position attends to the kept positions only, as in the nested tensor;
- ops on each position alone, where a layer runs its Python composition instead (a
  forward hook on it): pointwise ops, ``native_layer_norm`` over trailing dims,
  ``mm``/``addmm`` with the positions as rows, views between (N, L, ...) and
  (N * L, ...), dropout, ``detach``/``clone``, a dtype change;
- ``to_padded_tensor(padding, output_size)``: ``padding`` past each row's length, then
  padded (or cut, down to the longest row) to ``output_size``, with CPU's checks;
- ``_to_copy`` to another device (``.cpu()`` in a hook): CPU's nested tensor of the rows.

So kept positions get the nested values, and padded positions hold values nothing
reads until ``to_padded_tensor`` replaces them. A row of length 0 attends to all its
keys: its values are all replaced, and no NaN is computed. Every other op, and a
product or view that would mix positions, is refused (NotImplementedError naming it):
CPU's nested kernels run some of them, tpu has none to run them with.

The lengths are CPU's: the count of kept positions per row, which with
``mask_check=False`` and a mask that is not left-aligned packs each row's first
``count`` positions, as CPU does.

Under a trace (``torchjax.jit``) the mask's values are unknown. The alignment test then
answers True, and the stand-in takes the dense path's values where the mask turns out
not to be left-aligned: the keys masked are the mask's own and no position is replaced
(the lengths are L), which is what CPU's encoder computes after the test answers False.
So a traced encoder gives eager's values for every mask, except a mask that is not
left-aligned with ``mask_check=False``, where it gives the dense values and eager gives
CPU's packing of the first ``count`` positions. ``torch.compile`` does not ask: while
compiling, the encoder skips the test and runs densely (padded positions computed), and
with ``mask_check=False`` Dynamo leaves its frame to eager; both on CPU as on tpu.

Costs: the alignment test reads one flag back in eager, as on CPU and CUDA; the
length checks of ``to_padded_tensor`` are made at the op (Note [Device-side checks]),
one more read per call in eager and one per call of a program holding them.
"""

from __future__ import annotations

import math

import jax
import torch

from torchjax._compat.torch import disabled_torch_function_impl, pytree
from torchjax.device import _checks
from torchjax.ops import schema
from torchjax.ops.functional import device_error
from torchjax.ops.registry import handler
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap

aten = torch.ops.aten

_NO_ELEMENTS = "to_padded_tensor: at least one constituent tensor should have non-zero numel"
_TRUNCATION = (
    "Value in output_size is less than NestedTensor padded size. Truncation is not supported."
)


class PaddedNested(torch.Tensor):
    """tpu's stand-in for the nested tensor ``_nested_tensor_from_mask`` makes (Note
    [TransformerEncoder's nested path on tpu]), with the sizes, dtype and device of its
    padded values.

    Attributes (private): ``_padded`` the values, (N, L, ...) or, after a view that
    flattens the rows' positions, (N * L, ...); ``_pad_keys`` (N, L) bool, the keys each
    row does not attend to; ``_lengths`` (N,) int64, each row's length. Every stand-in
    made from one ``_nested_tensor_from_mask`` call shares the last two.
    """

    __torch_function__ = disabled_torch_function_impl
    # Ops reaching a JaxTensor's dispatch first come here next (Note [Tensor classes that
    # answer tpu ops] in torchjax/tensor/_tensor.py).
    _answers_tpu_ops = True

    @staticmethod
    def __new__(cls, padded: JaxTensor, pad_keys: JaxTensor, lengths: JaxTensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, padded.shape, dtype=padded.dtype, device=padded.device
        )
        t._padded, t._pad_keys, t._lengths = padded, pad_keys, lengths
        return t

    def __init__(self, *args, **kwargs):
        pass

    @property
    def is_nested(self) -> bool:
        return True

    def _positions(self) -> tuple:
        """The leading sizes that index positions: (N, L), or (N * L,) when flattened."""
        n, length = self._pad_keys.shape
        return (n, length) if tuple(self._padded.shape[:2]) == (n, length) else (n * length,)

    def _like(self, padded: JaxTensor) -> PaddedNested:
        return PaddedNested(padded, self._pad_keys, self._lengths)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"PaddedNested(rows={self._pad_keys.shape[0]}, size={tuple(self.shape)}, "
            f"dtype={self.dtype}, device='{self.device}')"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = _STAND_IN_OPS.get(func)
        if run is not None:
            return run(func, args, kwargs)
        if torch.Tag.pointwise in func.tags and not func._schema.is_mutable:
            return _per_position(func, args, kwargs)
        raise _refused(func)


def _refused(func, why: str = "") -> NotImplementedError:
    return NotImplementedError(
        f"torchjax: aten::{func._opname}.{func._overloadname}{why} on the padded tensor that "
        "torch._nested_tensor_from_mask returns on tpu. It stands in for a nested tensor "
        "(torch.nested is not supported on tpu) and answers the ops nn.TransformerEncoder "
        "applies to one: ops on each position (pointwise, layer norm, linear, dropout), "
        "views that keep the positions, attention, to_padded_tensor and .cpu(). Call "
        ".to_padded_tensor(0.0) first, or build the encoder with enable_nested_tensor=False."
    )


# ---------------------------------------------------------------------------------------
# making it


def _check_mask(func, t, mask) -> None:
    """CPU's argument checks of both ops, in its order."""
    for x in (t, mask):
        if not isinstance(x, JaxTensor):
            raise device_error(func, x)
    if mask.dtype != torch.bool:
        raise RuntimeError(
            "Expected mask to be of ScalarType Bool, but got "
            f"{dtypes.aten_type_name(mask.dtype)} instead."
        )
    if mask.dim() != 2:
        raise RuntimeError("Padding mask should be 2D")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    if tuple(t.shape[:2]) != tuple(mask.shape):
        raise RuntimeError("Mask size should match input size")
    if mask.shape[1] == 0:  # CPU reads each row's count at position L - 1
        raise IndexError(
            f"select(): index -1 out of range for tensor of size {list(mask.shape)} at dimension 1"
        )


def _alignment(mask: JaxTensor):
    """(each row's count of kept positions, whether every row keeps a prefix: 0-d bool),
    as CPU's test (the first unkept position equals the count)."""
    count = mask.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device) < count[:, None]
    return count, (prefix == mask).all()


def _traced(flag: JaxTensor) -> bool:
    return isinstance(flag.jax(), jax.core.Tracer)


@handler(aten._nested_tensor_from_mask_left_aligned.default)
def _nested_tensor_from_mask_left_aligned(args, kwargs):
    """aten::_nested_tensor_from_mask_left_aligned - whether every row of the (N, L) bool
    ``mask`` (True = keep) is a prefix of Trues, so that ``t`` (N, L, D) can be packed.
    Reads the answer back (as CPU and CUDA do); under a trace answers True (Note
    [TransformerEncoder's nested path on tpu])."""
    func = aten._nested_tensor_from_mask_left_aligned.default
    t, mask = schema.arg(args, kwargs, 0, "t"), schema.arg(args, kwargs, 1, "mask")
    _check_mask(func, t, mask)
    aligned = _alignment(mask)[1]
    if _traced(aligned):
        return True
    return bool(aligned.item())


@handler(aten._nested_tensor_from_mask.default)
def _nested_tensor_from_mask(args, kwargs):
    """aten::_nested_tensor_from_mask - pack ``t`` (N, L, D) by the (N, L) bool ``mask``
    (True = keep): row i keeps its first ``mask[i].sum()`` positions. Returns a
    ``PaddedNested`` (Note [TransformerEncoder's nested path on tpu]). ``mask_check``:
    refuse a mask that is not left-aligned (checked at the op, CPU's text)."""
    func = aten._nested_tensor_from_mask.default
    t, mask = schema.arg(args, kwargs, 0, "t"), schema.arg(args, kwargs, 1, "mask")
    mask_check = schema.arg(args, kwargs, 2, "mask_check", True)
    _check_mask(func, t, mask)
    if mask.shape[0] == 0:  # CPU stacks the rows
        raise RuntimeError("stack expects a non-empty TensorList")
    count, aligned = _alignment(mask)
    if mask_check:
        bad = ~aligned
        _checks.require(
            bad.jax(), 0, RuntimeError, "Mask must be left-aligned without gaps", deferred=False
        )
    length = mask.shape[1]
    if _traced(aligned):
        # The dense path's values where the mask is not left-aligned (see the Note).
        lengths = torch.where(aligned, count, length)
        pad_keys = ~mask
    else:
        lengths = count
        pad_keys = torch.arange(length, device=mask.device) >= count[:, None]
    pad_keys = pad_keys & (lengths > 0)[:, None]
    # The nested tensor is a copy: a later write into ``t`` does not reach it. A jax
    # array is immutable, so sharing it is that copy.
    padded = wrap(t.jax(), t._device_index)
    return PaddedNested(padded, pad_keys, lengths)


# ---------------------------------------------------------------------------------------
# the ops it answers


def _same_rows(func, tensors) -> PaddedNested:
    """The first stand-in among ``tensors``; all of them must come from one packing and
    index positions alike."""
    stand_ins = [t for t in tensors if isinstance(t, PaddedNested)]
    first = stand_ins[0]
    for other in stand_ins[1:]:
        if other._lengths is not first._lengths or other._positions() != first._positions():
            raise _refused(func, " of two differently packed tensors")
    return first


def _per_position(func, args, kwargs):
    """An op acting on each position alone (a pointwise op, a layer norm over trailing
    dims, a product with a weight): its value on the padded values is the nested one at
    the rows' positions, and a stand-in again."""
    first = _same_rows(func, pytree.tree_leaves((args, kwargs)))
    positions = first._positions()
    args, kwargs = pytree.tree_map_only(PaddedNested, lambda t: t._padded, (args, kwargs))
    out = func(*args, **kwargs)

    def rewrap(r):
        if tuple(r.shape[: len(positions)]) != positions:
            raise _refused(func, f" (a result of size {tuple(r.shape)})")
        return first._like(r)

    return pytree.tree_map_only(torch.Tensor, rewrap, out)


def _layer_norm(func, args, kwargs):
    """aten::native_layer_norm over trailing dims only: per position."""
    self, normalized_shape = args[0], args[1]
    if not isinstance(self, PaddedNested) or len(normalized_shape) > self.dim() - len(
        self._positions()
    ):
        raise _refused(func, " over positions")
    return _per_position(func, args, kwargs)


def _product(func, args, kwargs):
    """aten::mm / aten::addmm with the stand-in's rows as the left factor: per position."""
    mat1, mat2 = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
    if not isinstance(mat1, PaddedNested) or isinstance(mat2, PaddedNested):
        raise _refused(func, " contracting over positions")
    return _per_position(func, args, kwargs)


def _view(func, args, kwargs):
    """aten::view / aten::_unsafe_view between (N, L, ...) and (N * L, ...)."""
    self, size = args[0], list(args[1])
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = self.numel() // known if known else 0
    n, length = self._pad_keys.shape
    if tuple(size[:2]) != (n, length) and size[:1] != [n * length]:
        raise _refused(func, f" to size {tuple(size)}, which moves positions")
    return self._like(func(self._padded, size))


def _to_copy(func, args, kwargs):
    """aten::_to_copy: a tpu copy (another dtype) per position; a copy to another device
    is CPU's nested tensor of the rows' positions (the rows of their lengths)."""
    self = args[0]
    device = kwargs.get("device")
    if device is None or torch.device(device).type == self.device.type:
        return _per_position(func, args, kwargs)
    if self._positions() != tuple(self._pad_keys.shape) or self.dim() != 3:
        raise _refused(func, " of a flattened or non-3-D packing")
    values = func(self._padded, **kwargs)
    keep = torch.arange(self.shape[1], device=self.device) < self._lengths[:, None]
    return aten._nested_tensor_from_mask.default(values, keep.to(values.device), mask_check=False)


def _attention(func, args, kwargs):
    """aten::_native_multi_head_attention of a stand-in with itself, without weights: the
    dense lowering with the keys past each row's length masked."""
    query, key, value = args[:3]
    if not all(isinstance(t, PaddedNested) for t in (query, key, value)):
        raise _refused(func, " of a packed and an unpacked tensor")
    self = _same_rows(func, [query, key, value])
    if schema.arg(args, kwargs, 9, "mask") is not None:
        raise RuntimeError("NestedTensor with mask is not supported yet")
    if schema.arg(args, kwargs, 10, "need_weights", True):
        raise _refused(func, " with need_weights=True")
    params = [schema.arg(args, kwargs, i, _ATTENTION_ARGS[i]) for i in range(3, 9)]
    out, _ = func(
        query._padded, key._padded, value._padded, *params, self._pad_keys, False, True, 1
    )
    return self._like(out), None


def _encoder_layer(func, args, kwargs):
    """aten::_transformer_encoder_layer_fwd of a stand-in: the dense lowering with the
    keys past each row's length masked."""
    self = args[0]
    if schema.arg(args, kwargs, 18, "mask") is not None:
        raise RuntimeError("NestedTensor with mask is not supported yet")
    params = [schema.arg(args, kwargs, i, _LAYER_ARGS[i]) for i in range(1, 18)]
    return self._like(func(self._padded, *params, self._pad_keys, 1))


def _to_padded_tensor(func, args, kwargs):
    """aten::to_padded_tensor of a stand-in: ``padding`` past each row's length; shape
    ``output_size`` (at least each dimension's largest row: N, the longest row's length,
    D) or, without it, (N, longest row's length, D). Dtype: the input's."""
    self = args[0]
    padding = schema.arg(args, kwargs, 1, "padding")
    output_size = schema.arg(args, kwargs, 2, "output_size")
    if self._positions() != tuple(self._pad_keys.shape) or self.dim() != 3:
        raise _refused(func, " of a flattened or non-3-D packing")
    n, length, d = self.shape
    lengths = self._lengths
    if d == 0:
        raise RuntimeError(_NO_ELEMENTS)
    no_elements = lengths.sum() == 0
    _checks.require(no_elements.jax(), 0, RuntimeError, _NO_ELEMENTS, deferred=False)
    position = torch.arange(length, device=self.device)
    out = aten.masked_fill.Scalar(self._padded, (position >= lengths[:, None])[..., None], padding)
    if output_size is None:
        longest = int(lengths.max().item())  # the shape depends on it: eager only
        return out[:, :longest].contiguous()
    if len(output_size) != 3:
        raise RuntimeError(
            "Length of output_size does not match NestedTensor dims. Broadcasting is not supported."
        )
    want_n, want_length, want_d = output_size
    if want_n < n or want_d < d:
        raise RuntimeError(_TRUNCATION)
    if want_length < length:
        too_long = lengths.max() > want_length
        _checks.require(too_long.jax(), 0, RuntimeError, _TRUNCATION, deferred=False)
        out = out[:, :want_length]
    pad = [0, want_d - d, 0, want_length - out.shape[1], 0, want_n - n]
    return aten.constant_pad_nd.default(out, pad, padding)


_LAYER_ARGS = [a.name for a in aten._transformer_encoder_layer_fwd.default._schema.arguments]
_ATTENTION_ARGS = [a.name for a in aten._native_multi_head_attention.default._schema.arguments]

_STAND_IN_OPS = {
    aten._transformer_encoder_layer_fwd.default: _encoder_layer,
    aten._native_multi_head_attention.default: _attention,
    aten.to_padded_tensor.default: _to_padded_tensor,
    aten.native_layer_norm.default: _layer_norm,
    aten.mm.default: _product,
    aten.addmm.default: _product,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten._to_copy.default: _to_copy,
    aten.native_dropout.default: _per_position,
    aten.detach.default: _per_position,
    aten.clone.default: _per_position,
    aten.alias.default: _per_position,
}
