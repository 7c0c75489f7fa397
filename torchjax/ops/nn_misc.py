"""Assorted nn lowerings: embedding_bag (+ backward ops), pdist, rrelu.

The rest of the nn.functional long tail (unfold, pixel_shuffle, channel_shuffle, one_hot,
normalize, local_response_norm, prelu, cosine_similarity, pairwise_distance, softmin)
reaches ops lowered elsewhere through torch._decomp and needs no lowering of its own;
tests/ops/test_nn_misc.py checks it.

Under jit: embedding_bag's bag membership is computed with jnp (searchsorted over the
offsets), nothing reads values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops.indexing import require_in_range
from torchjax.ops.registry import handler, lowering

aten = torch.ops.aten

_SUM, _MEAN, _MAX = 0, 1, 2


# ---------------------------------------------------------------------------------------
# embedding_bag


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
def _bags(indices, offsets, include_last_offset, padding_idx, stop_at_last=False):
    n = indices.shape[0]
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    pos = jnp.arange(n, dtype=offsets.dtype)
    offset2bag = jnp.searchsorted(offsets[:n_bags], pos, side="right") - 1
    offset2bag = offset2bag.astype(jnp.int64)
    member = offset2bag < n_bags
    valid = member if padding_idx < 0 else member & (indices != padding_idx)
    counted = valid
    if stop_at_last and include_last_offset:
        # Out of every sum, still counted in the last bag's size (the Note above).
        valid = valid & (pos < offsets[n_bags])
    return offset2bag, valid, counted, n_bags


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
    offset2bag, valid, counted, n_bags = _bags(
        indices, offsets, include_last_offset, padding_idx, stop_at_last=fast_path
    )
    rows = jnp.take(weight, jnp.clip(indices, 0, weight.shape[0] - 1), axis=0)
    seg = jnp.where(valid, offset2bag, n_bags)
    bag_size = jax.ops.segment_sum(
        counted.astype(jnp.int64), jnp.where(counted, offset2bag, n_bags), n_bags + 1
    )[:n_bags]
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
        empty = (bag_size == 0)[:, None]
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
        keep = (bag_size > 0)[:, None]
        return out.at[maximum_indices, cols].add(jnp.where(keep, grad, 0), mode="drop")
    member = offset2bag < n_bags
    valid = member if padding_idx < 0 else member & (indices != padding_idx)
    g = jnp.take(grad, jnp.minimum(offset2bag, n_bags - 1), axis=0)
    if mode == _MEAN:
        g = g / jnp.maximum(jnp.take(bag_size, jnp.minimum(offset2bag, n_bags - 1)), 1)[
            :, None
        ].astype(g.dtype)
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


# ---------------------------------------------------------------------------------------
# pdist


def _pairs(n):
    i, j = np.triu_indices(n, k=1)
    return jnp.asarray(i), jnp.asarray(j)


def _check_pdist(op, self, p):
    if self.ndim != 2:
        raise RuntimeError(f"{op}: pdist only supports 2D tensors, got: {self.ndim}D")
    if p < 0:
        raise RuntimeError(f"{op}: pdist only supports non-negative p values, got {p}")


@lowering(aten._pdist_forward)
def _pdist_forward(self, p=2.0):
    """aten::_pdist_forward - p-norm distance of every row pair i < j, row-major order.

    Shapes: (N, M) -> (N * (N - 1) / 2,). p = 0 counts differing coordinates, p = inf is
    the max. Dtypes: self's (floating). Reference: ATen Distance.cpp.
    """
    _check_pdist("aten::_pdist_forward", self, p)
    i, j = _pairs(self.shape[0])
    diff = jnp.abs(self[i] - self[j])
    if p == 0:
        return (diff != 0).sum(axis=1).astype(self.dtype)
    if p == float("inf"):
        return diff.max(axis=1, initial=0)
    if p == 1:
        return diff.sum(axis=1)
    if p == 2:
        return jnp.sqrt((diff * diff).sum(axis=1))
    return (diff**p).sum(axis=1) ** (1.0 / p)


@lowering(aten._pdist_backward)
def _pdist_backward(grad, self, p, pdist):
    """aten::_pdist_backward - gradient of _pdist_forward w.r.t. self.

    ATen's formulas, which give 0 where a distance (or, for p < 1, a coordinate
    difference) is 0 instead of the NaN a plain vjp of sqrt/pow would produce.
    """
    _check_pdist("aten::_pdist_backward", self, p)
    i, j = _pairs(self.shape[0])
    diff = self[i] - self[j]
    dist = pdist[:, None]
    zero = jnp.zeros((), self.dtype)
    if p == 0:
        coef = jnp.zeros_like(diff)
    elif p == 1:
        coef = jnp.sign(diff)
    elif p == float("inf"):
        coef = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p == 2:
        coef = jnp.where(dist == 0, zero, diff / jnp.where(dist == 0, 1, dist))
    else:
        safe = jnp.where(dist == 0, 1, dist)
        coef = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
        bad = dist == 0
        if p < 1:
            bad = bad | (diff == 0)
        coef = jnp.where(bad, zero, coef)
    contrib = grad[:, None] * coef
    out = jnp.zeros(self.shape, self.dtype)
    return out.at[i].add(contrib).at[j].add(-contrib)


# ---------------------------------------------------------------------------------------
# rrelu


@handler(aten.rrelu_with_noise.default)
def rrelu_with_noise(args, kwargs):
    """aten::rrelu_with_noise - randomized leaky relu; writes the slopes into ``noise``.

    Training: each x <= 0 gets a slope drawn uniformly from [lower, upper) (torchjax's RNG,
    so values differ from CPU torch), stored in ``noise`` (1 where x > 0); eval: a fixed
    slope (lower + upper) / 2. Reference: ATen Activation.cpp (rrelu_with_noise_out_cpu).
    """
    names = ("self", "noise", "lower", "upper", "training", "generator")
    bound = dict(zip(names, args), **kwargs)
    self, noise = bound["self"], bound["noise"]
    lower, upper = float(bound.get("lower", 0.125)), float(bound.get("upper", 1.0 / 3.0))
    if bound.get("generator") is not None:
        raise RuntimeError(
            "aten::rrelu_with_noise: generator= is not supported for tpu tensors; seed with "
            "torch.manual_seed"
        )
    if not bound.get("training", False):
        return torch.nn.functional.leaky_relu(self, (lower + upper) / 2)
    slopes = torch.empty_like(self).uniform_(lower, upper)
    r = torch.where(self <= 0, slopes, torch.ones_like(self))
    noise.copy_(r)
    return self * r
