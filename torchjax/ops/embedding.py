"""Embedding lookup and its dense backward.

``F.embedding`` reaches ``aten::embedding``; its backward is ``embedding_dense_backward``
(``sparse=True`` gradients are not supported on tpu: there is no sparse layout).
Out-of-range indices raise ``IndexError`` in eager, checked on the device and raised at
the next synchronisation point (or at the op with ``TORCHJAX_SYNC_CHECKS=1``; Note
[Device-side checks] in torchjax/device/_checks.py); under jit the check cannot run and
jax clamps the gather instead.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchjax.ops.indexing import require_in_range
from torchjax.ops.registry import functional_handler, handler, lowering

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
    Reference: torch.nn.functional.embedding."""
    if weight.ndim != 2:
        raise RuntimeError(f"aten::embedding: 'weight' must be 2-D, got {weight.ndim}-D")
    _check_indices("embedding", indices, weight.shape[0])
    return jnp.take(weight, indices, axis=0)


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
