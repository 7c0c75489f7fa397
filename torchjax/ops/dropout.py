"""Dropout: ``native_dropout`` and its backward. The mask is drawn from the per-device RNG
state as every random op is (ops/random.py's module docstring): reproducible under
``torch.manual_seed``, not CPU torch's values.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops.random import _bernoulli_mask, _key, _opmath
from torchjax.ops.registry import Kind, lowering
from torchjax.ops.writeback import check_castable
from torchjax.tensor.dtypes import to_torch_dtype

aten = torch.ops.aten


@lowering(aten.native_dropout.default)
def native_dropout(input, p, train=None):
    """aten::native_dropout - (input * mask / (1 - p), mask) in training, else
    (input copy, all-True mask).

    Mask is bool, kept with probability 1 - p; p == 1 gives zeros (scale 0, as torch
    avoids 1/0). f16/bf16 scaled in float32. Reference: ATen Dropout.cpp.
    """
    if not 0 <= p <= 1:
        raise RuntimeError(
            f"dropout probability has to be between 0 and 1, but got {p} (in aten::native_dropout)"
        )
    if train is False or input.size == 0:
        return jnp.array(input, copy=True), jnp.ones(input.shape, dtype=jnp.bool_)
    # CPU scales the kept values in place, in the input's dtype: a float scale refused.
    check_castable(aten.native_dropout.default, torch.float32, to_torch_dtype(input.dtype))
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    mask = _bernoulli_mask(_key(input), input.shape, p1m)  # Note [One Bernoulli draw]
    ct = _opmath(input.dtype)
    out = jnp.where(mask, input.astype(ct) * np.asarray(scale, ct), jnp.zeros((), ct))
    return out.astype(input.dtype), mask


@lowering(
    aten.native_dropout_backward.default,
    promote=Kind.DEFAULT,
    promote_args=("grad_output", "mask", "scale"),
)
def native_dropout_backward(grad_output, mask, scale):
    """aten::native_dropout_backward - grad_output * mask * scale.

    Dtypes: torch's promotion of the three (a float mask or an integer grad promote);
    f16/bf16 computed in float32. Reference: ATen Dropout.cpp.
    """
    return grad_output * mask * scale
