"""Gradient-scaler kernels for ``torch.amp.GradScaler("tpu")``: unscale and inf check,
scale update. Both run on device (no host read), so a scaler step does not sync.

Reference: ATen/native/cpu/AmpGradScalerKernels.cpp (the CPU kernels these match).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchjax.ops.registry import handler
from torchjax.ops.writeback import write_into
from torchjax.tensor._tensor import wrap

aten = torch.ops.aten


@jax.jit
def _unscale(grads, found_inf, inv_scale):
    # Every gradient is multiplied by inv_scale (in float32 for half types, as ATen's opmath)
    # whether or not a non-finite value was found; found_inf becomes 1 if any was.
    out, found = [], found_inf
    for g in grads:
        ct = jnp.promote_types(g.dtype, jnp.float32)
        out.append((g.astype(ct) * inv_scale.astype(ct)).astype(g.dtype))
        found = jnp.where(jnp.all(jnp.isfinite(g)), found, jnp.ones_like(found))
    return out, found


@handler(aten._amp_foreach_non_finite_check_and_unscale_.default)
def amp_foreach_non_finite_check_and_unscale_(args, kwargs):
    """aten::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale) -
    ``grads *= inv_scale`` in place; ``found_inf`` (float32 [1]) set to 1.0 if any gradient
    holds inf or NaN. Errors: a non-tpu tensor raises the mixed-device error."""
    bound = dict(zip(("self", "found_inf", "inv_scale"), args), **kwargs)
    grads, found_inf, inv_scale = bound["self"], bound["found_inf"], bound["inv_scale"]
    func = aten._amp_foreach_non_finite_check_and_unscale_.default
    if not grads:
        return None
    new, found = _unscale([g._value() for g in grads], found_inf._value(), inv_scale._value())
    for g, arr in zip(grads, new):
        write_into(func, g, wrap(arr))
    write_into(func, found_inf, wrap(found))
    return None


@jax.jit
def _update_scale(scale, tracker, found_inf, growth, backoff, interval):
    found = found_inf > 0
    successful = tracker + 1
    grow = jnp.logical_and(~found, successful == interval)
    grown = (scale * growth).astype(scale.dtype)
    new_scale = jnp.where(
        found, scale * backoff, jnp.where(grow & jnp.isfinite(grown), grown, scale)
    ).astype(scale.dtype)
    new_tracker = jnp.where(found | grow, jnp.zeros_like(tracker), successful)
    return new_scale, new_tracker


@handler(aten._amp_update_scale_.default)
def amp_update_scale_(args, kwargs):
    """aten::_amp_update_scale_(self, growth_tracker, found_inf, scale_growth_factor,
    scale_backoff_factor, growth_interval) - the scale (float32 [1], in place) backs off
    when ``found_inf``, else grows after ``growth_interval`` successful steps in a row (if
    the grown scale is finite); ``growth_tracker`` (int32 [1]) counts them. Returns self."""
    names = ("self", "growth_tracker", "found_inf", "scale_growth_factor")
    names += ("scale_backoff_factor", "growth_interval")
    b = dict(zip(names, args), **kwargs)
    func = aten._amp_update_scale_.default
    scale, tracker = b["self"], b["growth_tracker"]
    new_scale, new_tracker = _update_scale(
        scale._value(),
        tracker._value(),
        b["found_inf"]._value(),
        jnp.float64(b["scale_growth_factor"]),
        jnp.float64(b["scale_backoff_factor"]),
        jnp.asarray(b["growth_interval"], dtype=tracker._value().dtype),
    )
    write_into(func, scale, wrap(new_scale))
    write_into(func, tracker, wrap(new_tracker))
    return scale
