"""Embedding lookup and its dense backward.

``F.embedding`` reaches ``aten::embedding``; its backward is ``embedding_dense_backward``
(``sparse=True`` gradients are not supported on tpu: there is no sparse layout).
Out-of-range indices raise ``IndexError``, checked on the device and raised at the next
synchronisation point (or at the op with ``TORCHJAX_SYNC_CHECKS=1``; Note [Device-side
checks] in torchjax/device/_checks.py), after a ``torchjax.jit``/``torch.compile`` call
too (Note [Device checks of compiled programs]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops.indexing import require_in_range
from torchjax.ops.registry import functional_handler, handler, lowering, precheck
from torchjax.ops.schema import arg

aten = torch.ops.aten


def _check_indices(name, indices, num_weights):
    if indices.dtype not in (jnp.int32, jnp.int64):
        raise RuntimeError(
            f"aten::{name}: expected indices of scalar type Long or Int, but got {indices.dtype}"
        )
    # On the device, raised at the next sync (Note [Device-side checks]).
    require_in_range(
        indices,
        0,
        num_weights,
        IndexError,
        f"aten::{name}: index out of range in self (index {{value}}, {num_weights} rows)",
    )


@handler(aten.embedding.default)
def embedding_handler(args, kwargs):
    """aten::embedding, refusing ``sparse=True`` when a gradient will be needed.

    Sparse gradients have no tpu layout; failing in forward gives a clear error instead of
    one raised from deep inside the backward pass."""
    weight = args[0]
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    if sparse and weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "torchjax: nn.Embedding(sparse=True) / F.embedding(..., sparse=True) needs sparse "
            "gradients, which do not exist on device 'tpu' (a jax.Array is dense). Use "
            "sparse=False: the dense gradient is what XLA computes efficiently."
        )
    return _embedding(args, kwargs)


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """aten::embedding - weight[indices]: shape indices.shape + weight.shape[1:].

    ``padding_idx``, ``scale_grad_by_freq`` only matter to the backward. Dtypes: weight's.
    Reference: torch.nn.functional.embedding. Eager backward is
    ``embedding_dense_backward``; a torchjax.jit program's is jax's VJP of this
    function, so the rows of ``padding_idx`` are read through ``stop_gradient`` (the
    same values) to give them no gradient there too."""
    if weight.ndim != 2:
        raise RuntimeError(f"aten::embedding: 'weight' must be 2-D, got {weight.ndim}-D")
    _check_indices("embedding", indices, weight.shape[0])
    out = jnp.take(weight, indices, axis=0)
    if padding_idx is not None and padding_idx >= 0:
        out = jnp.where((indices == padding_idx)[..., None], lax.stop_gradient(out), out)
    return out


_embedding = functional_handler(aten.embedding.default, embedding)


@lowering(aten.embedding_dense_backward)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """aten::embedding_dense_backward - scatter-add grad_output rows into a
    (num_weights, D) zero tensor; rows of ``padding_idx`` get no gradient; with
    ``scale_grad_by_freq`` each row's gradient is divided by its index's count.

    Dtypes: grad_output's; f16/bf16 accumulated in float32 (as ATen's CPU kernel)."""
    d = grad_output.shape[-1]
    acc = jnp.float32 if grad_output.dtype in (jnp.bfloat16, jnp.float16) else grad_output.dtype
    idx = indices.reshape(-1)
    g = grad_output.reshape(-1, d).astype(acc)
    if padding_idx is not None and padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), acc), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), acc).at[idx].add(jnp.ones((), acc))
        g = g / counts[idx][:, None]
    out = jnp.zeros((num_weights, d), acc).at[idx].add(g)
    return out.astype(grad_output.dtype)


@lowering(aten.embedding_renorm, aten.embedding_renorm_)
def embedding_renorm(self, indices, max_norm, norm_type):
    """aten::embedding_renorm_ - rescale each row of ``self`` named in ``indices`` whose
    ``norm_type``-norm exceeds ``max_norm`` to norm max_norm (``F.embedding(max_norm=)``).

    The scale is max_norm / (norm + 1e-7), as ATen. Dtypes: self's; norms in opmath."""
    _check_indices("embedding_renorm_", indices, self.shape[0])
    acc = jnp.float32 if self.dtype in (jnp.bfloat16, jnp.float16) else self.dtype
    rows = self.astype(acc)
    norms = jnp.sum(jnp.abs(rows) ** norm_type, axis=1) ** (1.0 / norm_type)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), jnp.ones((), acc))
    hit = jnp.zeros((self.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scaled = rows * jnp.where(hit, scale, jnp.ones((), acc))[:, None]
    return scaled.astype(self.dtype)


@handler(
    aten._sparse_coo_tensor_with_dims_and_tensors.default,
    aten._sparse_coo_tensor_with_dims.default,
)
def sparse_coo_tensor(args, kwargs):
    """Sparse tensors do not exist on tpu (a jax.Array is dense); reached by
    ``Embedding(sparse=True)``'s backward. Raise a clear error instead."""
    raise NotImplementedError(
        "torchjax: sparse tensors are not supported on device 'tpu' (reached through "
        "aten::_sparse_coo_tensor_with_dims_and_tensors, e.g. nn.Embedding(sparse=True) "
        "or F.embedding(..., sparse=True) gradients). Use sparse=False: the dense "
        "gradient is what XLA computes efficiently."
    )


# ---------------------------------------------------------------------------------------
# embedding_bag
#
# Under jit: bag membership is computed with jnp (searchsorted over the offsets), nothing
# reads values. Offsets CPU refuses (``offsets[0] != 0``, ``offsets[-1]`` past the input)
# raise at the op, as on CPU; indices out of range at the next synchronisation point, as
# CUDA's device assert (``_check_offsets``, Note [Device-side checks]).

_SUM, _MEAN, _MAX = 0, 1, 2


# Note [The last offset of embedding_bag]
# With include_last_offset, ``offsets[-1]`` should be ``len(indices)``. When it is smaller,
# ATen's CPU kernel does one of two things, by path. Its fast path (sum or mean of
# float32/float16/bfloat16 rows, no padding_idx) sums each bag up to the next offset, so
# the indices past ``offsets[-1]`` are in no bag (nor in the gradient), while the bag
# sizes it divides a mean by still run to the end of indices (the last bag of
# [1, 2, 4, 5, 4, 3, 2, 9, 2, 2] with offsets [0, 2, 2, 5, 9] sums four rows and divides
# by five). Every other path (max, float64, a padding_idx) puts them in the last bag.
# Both are followed, since either is what CPU returns for that call. Its backward then
# leaves them out of a sum's gradient and keeps them in a mean's (float32; its half-type
# backward read uninitialised memory there), and so does this one: a sum's
# ``offset2bag`` marks them in no bag.
#
# Note [Decreasing offsets of embedding_bag]
# CPU builds ``offset2bag`` by counting the offsets at or before each position (an
# index_add of ones at the offsets, then a cumsum), whatever their order, so offsets
# [0, 3, 2] put positions 0-1, 2 and 3-4 in bags 0, 1 and 2, as sorted offsets would;
# its bag sizes are the offsets' differences (3, -1, 3), less the padding_idx rows, and a
# mean divides by at least 1. That is what its max, float64 and padding_idx paths
# return, and this lowering too. Its fast path (the one ``stop_at_last`` follows) hands
# the offsets to FBGEMM, which refuses a decreasing pair; ATen's report then walks the
# bags and raises "Expected i < index_size" when the bags' lengths add up past the
# indices, else the last offset's message (``_check_decreasing``).
def _bags(indices, offsets, include_last_offset, padding_idx, stop_at_last=False):
    n = indices.shape[0]
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    pos = jnp.arange(n, dtype=offsets.dtype)
    starts = jnp.sort(offsets[:n_bags])  # Note [Decreasing offsets of embedding_bag]
    offset2bag = jnp.searchsorted(starts, pos, side="right") - 1
    offset2bag = offset2bag.astype(jnp.int64)
    member = offset2bag < n_bags
    valid = member if padding_idx < 0 else member & (indices != padding_idx)
    counted = valid
    if stop_at_last and include_last_offset:
        # Out of every sum, still counted in the last bag's size (the Note above).
        valid = valid & (pos < offsets[n_bags])
    return offset2bag, valid, counted, n_bags


# CPU's text prints offsets[0] as a 0-d tensor of the indices' and offsets' common type.
_TENSOR_TYPES = {jnp.dtype(jnp.int64): "LongTensor", jnp.dtype(jnp.int32): "IntTensor"}


def _check_offsets(indices, offsets):
    """EmbeddingBag.cpp's ``check_arguments``: ``offsets[0]`` is 0 and ``offsets[-1]`` at
    most ``len(indices)``, read back on the host by CPU; CUDA checks neither (its kernels
    take the first bag from 0), so a check at the op (Note [Device-side checks] in
    torchjax/device/_checks.py), with CPU's text."""
    if offsets.size == 0:
        return
    kind = _TENSOR_TYPES.get(jnp.promote_types(indices.dtype, offsets.dtype), "LongTensor")
    _checks.require(
        offsets[0] != 0,
        offsets[0],
        RuntimeError,
        "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start "
        "from position 0. However, got {value}\n[ torch." + kind + "{{}} ]",
        deferred=False,
    )
    n = indices.shape[0]
    _checks.require(
        offsets[-1] > n,
        (offsets[-1], n),
        RuntimeError,
        "offsets[-1] can not be greater than input's length {value2} but got offsets[-1] of "
        "{value}",
        deferred=False,
    )


_INDEX_SIZE = (
    "Expected i < index_size to be true, but got false.  (Could this error message be "
    "improved?  If so, please report an enhancement request to PyTorch.)"
)
_LAST_OFFSET = (
    "Your input appears to be incorrect: the last offset value should be the size of the "
    "indices tensor, but it seems not to be the case."
)


def _bag_sizes(offsets, n, n_bags, offset2bag, valid, member):
    """CPU's ``bag_size``: the offsets' differences (the last bag to the end of the
    indices), less the padding_idx rows each bag holds (Note [Decreasing offsets of
    embedding_bag]); for non-decreasing offsets, the rows counted in each bag."""
    if n_bags == 0:
        return jnp.zeros((0,), jnp.int64)
    starts = offsets[:n_bags].astype(jnp.int64)
    ends = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int64)])
    padded = (member & ~valid).astype(jnp.int64)
    padded = jax.ops.segment_sum(padded, jnp.where(member, offset2bag, n_bags), n_bags + 1)
    return ends - starts - padded[:n_bags]


def _check_decreasing(indices, offsets, include_last_offset):
    """CPU's fast path refuses decreasing offsets (Note [Decreasing offsets of
    embedding_bag]) at the op, as its other offset checks (``_check_offsets``)."""
    n = indices.shape[0]
    bounds = offsets.astype(jnp.int64)
    if not include_last_offset:
        bounds = jnp.concatenate([bounds, jnp.full((1,), n, jnp.int64)])
    if bounds.shape[0] < 2:
        return
    lengths = bounds[1:] - bounds[:-1]
    decreasing = jnp.any(lengths < 0)
    past = jnp.sum(jnp.maximum(lengths, 0)) > n
    _checks.require(decreasing & past, 0, RuntimeError, _INDEX_SIZE, deferred=False)
    _checks.require(decreasing & ~past, 0, RuntimeError, _LAST_OFFSET, deferred=False)


@lowering(aten._embedding_bag, aten._embedding_bag_forward_only)
def _embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """aten::_embedding_bag - reduce weight rows per bag: sum, mean or max.

    Shapes: weight (V, D), indices (n,), offsets (B,) or (B + 1,) under
    include_last_offset -> (output (B, D), offset2bag (n,), bag_size (B,),
    max_indices (B, D), meaningful in max mode). Empty bags give zero rows.
    per_sample_weights scales rows (sum mode only); padding_idx rows are skipped and not
    counted in a mean. Dtypes: output weight's, the rest int64.
    Reference: ATen EmbeddingBag.cpp.
    """
    if indices.ndim != 1 or offsets.ndim != 1:
        raise ValueError(
            f"aten::_embedding_bag: expected 1-D indices and offsets, got shapes "
            f"{tuple(indices.shape)} and {tuple(offsets.shape)}"
        )
    if per_sample_weights is not None and mode != _SUM:
        raise NotImplementedError(
            "aten::_embedding_bag: per_sample_weights only supported with mode='sum'"
        )
    _check_offsets(indices, offsets)
    # torch's range check (a clipped index would silently read the last row).
    require_in_range(
        indices,
        0,
        weight.shape[0],
        RuntimeError,
        f"embedding_bag: an index takes value {{value}} which is not in the valid range "
        f"[0, {weight.shape[0]}) (in aten::_embedding_bag)",
    )
    fast_path = (
        mode != _MAX
        and padding_idx < 0
        and weight.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
    )
    if fast_path:
        _check_decreasing(indices, offsets, include_last_offset)
    offset2bag, valid, counted, n_bags = _bags(
        indices, offsets, include_last_offset, padding_idx, stop_at_last=fast_path
    )
    rows = jnp.take(weight, jnp.clip(indices, 0, weight.shape[0] - 1), axis=0)
    seg = jnp.where(valid, offset2bag, n_bags)
    member = offset2bag < n_bags
    bag_size = _bag_sizes(offsets, indices.shape[0], n_bags, offset2bag, counted, member)
    if fast_path and mode == _SUM:
        offset2bag = jnp.where(valid | ~counted, offset2bag, n_bags)
    d = weight.shape[1]
    if mode == _MAX:
        low = jnp.array(-jnp.inf, dtype=weight.dtype)
        masked = jnp.where(valid[:, None], rows, low)
        out = jax.ops.segment_max(masked, seg, n_bags + 1)[:n_bags]
        hit = (masked == out[jnp.minimum(seg, n_bags - 1)]) & valid[:, None]
        # The first position reaching the max, as ATen's strict '>' update.
        pos = jnp.where(hit, jnp.arange(indices.shape[0])[:, None], indices.shape[0])
        first = jax.ops.segment_min(pos, seg, n_bags + 1)[:n_bags]
        max_indices = jnp.where(
            first < indices.shape[0],
            jnp.take(indices, jnp.minimum(first, indices.shape[0] - 1)),
            -1,
        ).astype(jnp.int64)
        # a bag no row reached (its size, an offsets' difference, can be -1 or more)
        empty = (jax.ops.segment_sum(valid.astype(jnp.int32), seg, n_bags + 1)[:n_bags] == 0)[
            :, None
        ]
        out = jnp.where(empty, jnp.zeros((), weight.dtype), out)
        max_indices = jnp.where(empty, 0, max_indices)
        return out, offset2bag, bag_size, max_indices
    # Half-precision bags are weighted and summed in float32 and rounded once, as ATen's
    # CPU kernel accumulates them (summing in bfloat16 loses ~3 bits on a 5-row bag).
    if rows.dtype in (jnp.bfloat16, jnp.float16):
        rows = rows.astype(jnp.float32)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    rows = jnp.where(valid[:, None], rows, jnp.zeros((), rows.dtype))
    out = jax.ops.segment_sum(rows, seg, n_bags + 1)[:n_bags]
    if mode == _MEAN:
        out = out / jnp.maximum(bag_size, 1)[:, None].astype(out.dtype)
    return out.astype(weight.dtype), offset2bag, bag_size, jnp.zeros((n_bags, d), jnp.int64)


def _bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    d = grad.shape[1]
    n_bags = grad.shape[0]
    if mode == _MAX:
        out = jnp.zeros((num_weights, d), dtype=grad.dtype)
        cols = jnp.broadcast_to(jnp.arange(d), maximum_indices.shape)
        keep = (bag_size != 0)[:, None]  # CPU: the bags of nonzero size, -1 included
        return out.at[maximum_indices, cols].add(jnp.where(keep, grad, 0), mode="drop")
    member = offset2bag < n_bags
    valid = member if padding_idx < 0 else member & (indices != padding_idx)
    g = jnp.take(grad, jnp.minimum(offset2bag, n_bags - 1), axis=0)
    if mode == _MEAN:
        # CPU divides by the size itself: -1 for a bag after a decreasing offset (Note
        # [Decreasing offsets of embedding_bag]); a bag holding rows has no size 0.
        size = jnp.take(bag_size, jnp.minimum(offset2bag, n_bags - 1))
        g = g / jnp.where(size == 0, 1, size)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        g = g * per_sample_weights[:, None].astype(g.dtype)
    g = jnp.where(valid[:, None], g, jnp.zeros((), g.dtype))
    if scale_grad_by_freq:
        # Note [embedding_bag scale_grad_by_freq]: each row is divided by its index's
        # count over the whole input, as on CUDA/MPS and in embedding_dense_backward.
        # CPU torch (2.13) divides by counts[indices_data[i]] with i the unique-group
        # counter of _embedding_bag_dense_backward_cpu_sum_mean, a bug
        # (pytorch/pytorch#190063): CPU's numbers are not followed there.
        counts = jnp.zeros((num_weights,), jnp.int64).at[indices].add(valid.astype(jnp.int64))
        g = g / jnp.maximum(jnp.take(counts, indices), 1)[:, None].astype(g.dtype)
    return jnp.zeros((num_weights, d), dtype=grad.dtype).at[indices].add(g, mode="drop")


@lowering(aten._embedding_bag_backward)
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    """aten::_embedding_bag_backward - dense gradient of weight (V, D).

    sum/mean: each index's row gets its bag's grad (divided by the bag size for mean,
    scaled by per_sample_weights, by 1/frequency under scale_grad_by_freq); max: the grad
    goes to the arg-max row per feature. sparse=True has no tpu layout and raises.
    """
    if sparse:
        raise NotImplementedError(
            "aten::_embedding_bag_backward: sparse gradients do not exist on device 'tpu'; "
            "use sparse=False"
        )
    return _bag_dense_backward(
        grad,
        indices,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


# aten::_embedding_bag_dense_backward: _embedding_bag_backward with sparse=False, same
# arguments in the same order.
lowering(aten._embedding_bag_dense_backward)(_bag_dense_backward)


@lowering(aten._embedding_bag_per_sample_weights_backward)
def _embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
    """aten::_embedding_bag_per_sample_weights_backward - <grad[bag], weight[index]> per
    index (0 for padding_idx). Only mode='sum' has per_sample_weights."""
    if mode != _SUM:
        raise NotImplementedError(
            "aten::_embedding_bag_per_sample_weights_backward: only mode='sum' is supported"
        )
    n_bags = grad.shape[0]
    g = jnp.take(grad, jnp.minimum(offset2bag, n_bags - 1), axis=0)
    rows = jnp.take(weight, jnp.clip(indices, 0, weight.shape[0] - 1), axis=0)
    out = (g * rows).sum(axis=1)
    valid = offset2bag < n_bags
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.where(valid, out, jnp.zeros((), out.dtype))


_BAG_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@precheck(aten.embedding_bag, aten._embedding_bag, aten._embedding_bag_forward_only)
def _embedding_bag_weight_dtype(args, kwargs):
    """EmbeddingBag.cpp's ``checkScalarTypes`` of the weight, with its text."""
    weight = arg(args, kwargs, 0, "weight")
    if weight.dtype not in _BAG_WEIGHT_DTYPES:
        # ATen's legacy type name; for bool it is "CPUBoolType", word for word.
        name = (
            "CPUBoolType"
            if weight.dtype == torch.bool
            else torch.empty(0, dtype=weight.dtype).type()
        )
        raise RuntimeError(
            "Expected tensor for argument #1 'weight' to have one of the following scalar "
            f"types: Half, BFloat16, Float, Double; but got {name} instead (while checking "
            "arguments for embedding_bag)"
        )
