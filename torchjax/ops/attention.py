"""Attention: what ``F.scaled_dot_product_attention`` needs on a tpu tensor.

How SDPA reaches us (torch 2.13): ``aten::scaled_dot_product_attention`` is
CompositeImplicitAutograd. Its backend choice (``_fused_sdp_choice_stub``) has no
PrivateUse1 kernel unless one is registered from C++, so for a tpu tensor it always takes
the math path, ``_scaled_dot_product_attention_math`` (also CompositeImplicit), above the
dispatcher. We therefore see its pieces: ``mul`` (q and k each scaled by sqrt(scale)),
``bmm``/``mm`` through ``matmul``, the mask as ``add`` (boolean masks first turned into
0 / -inf), ``_safe_softmax`` when a mask is given (``_softmax`` otherwise),
``native_dropout`` for ``dropout_p``, ``repeat_interleave`` for ``enable_gqa``, and
autograd differentiates those. Causal masks arrive as ``tril`` of ``ones`` plus
``masked_fill``.

Fully masked rows (a boolean mask that is all False in a row, e.g. left padding): CPU
torch returns zeros there, and so does ``_safe_softmax`` (the math path's softmax for
masked attention), so the result is finite and equal to CPU, not NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchjax.ops.norm import _check_dim, _opmath
from torchjax.ops.registry import lowering
from torchjax.tensor.dtypes import to_jax_dtype

aten = torch.ops.aten


@lowering(aten._safe_softmax)
def _safe_softmax(self, dim, dtype=None):
    """aten::_safe_softmax - softmax along ``dim``, but 0 (not NaN) on a slice whose
    inputs are all -inf (a fully masked attention row).

    Dtypes: input cast to ``dtype`` first when given; f16/bf16 computed in float32.
    Reference: torch/_decomp/decompositions.py (safe_softmax)."""
    out_dtype = self.dtype if dtype is None else to_jax_dtype(dtype)
    dim = _check_dim("_safe_softmax", self, dim)
    x = self.astype(out_dtype).reshape(self.shape or (1,))
    x = x.astype(_opmath(out_dtype))
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    out = jnp.where(masked, jnp.zeros((), x.dtype), jax.nn.softmax(x, axis=dim))
    return out.reshape(self.shape).astype(out_dtype)
