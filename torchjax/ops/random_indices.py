"""Random draws of indices: randperm and multinomial.

They draw as the samplers of ops/random.py do (a fresh key per draw from the device's
RNG state; Note [Compiled random ops] in torchjax/ops/_seeded.py); multinomial's checks
of the distribution follow Note [Device-side checks].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops.random import _check_float, _key
from torchjax.ops.registry import handler, lowering
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes
from torchjax.tensor import random as _rng
from torchjax.tensor._tensor import wrap

aten = torch.ops.aten


@handler(aten.randperm.generator_out, aten.randperm.out, cpu_generator=True)
def randperm_out(args, kwargs):
    """aten::randperm.out - a random permutation of ``0..n-1`` written into ``out``.
    Dtypes: ``out``'s (int64 by default). Reference: torch.randperm."""
    n, out = args[0], kwargs["out"]
    if n < 0:
        raise RuntimeError(f"n must be non-negative, got {n} (in aten::randperm)")
    _check_randperm(n, out.dtype)
    perm = jax.random.permutation(_rng.next_key(out._device_index), n)
    arr = perm.astype(dtypes.to_jax_dtype(out.dtype))
    return write_into(
        aten.randperm.out, out, wrap(arr, out._device_index), check_cast=False, resize=True
    )


# ATen's names of the integer types whose range ``randperm`` checks n - 1 against.
_C_INTS = {torch.int8: "int8_t", torch.uint8: "uint8_t", torch.int16: "int16_t"}
# Floating types whose integers stop being exact: n at most 2**digits + 1 (ATen names
# float16 only; bfloat16 has no check there).
_EXACT_UP_TO = {
    torch.float16: (2**11 + 1, "2049 for Half"),
    torch.float32: (2**24 + 1, "2^24+1 for Float"),
}


def _check_randperm(n: int, dtype) -> None:
    """CPU's checks of ``randperm(n, dtype=)``: a permutation the dtype cannot hold."""
    if dtype == torch.bool:
        raise NotImplementedError("\"randperm\" not implemented for 'Bool'")
    if dtype in _C_INTS and n - 1 > torch.iinfo(dtype).max:
        raise RuntimeError(f"value cannot be converted to type {_C_INTS[dtype]} without overflow")
    if dtype in _EXACT_UP_TO and n > _EXACT_UP_TO[dtype][0]:
        raise RuntimeError(f"n cannot be greater than {_EXACT_UP_TO[dtype][1]} type.")


@lowering(aten.multinomial.default, cpu_generator=True)
def multinomial(self, num_samples, replacement=False, *, generator=None):
    """aten::multinomial - ``num_samples`` category indices per row of ``self``
    (unnormalised, non-negative weights), with or without replacement.

    Shapes: (n,) -> (num_samples,); (m, n) -> (m, num_samples). Dtype int64. Without
    replacement we take the top ``num_samples`` of log(w) + Gumbel noise (equivalent to
    sequential sampling); as in torch, zero weights are drawn last when fewer than
    ``num_samples`` are positive. Reference: torch.multinomial.
    """
    op = "aten::multinomial"
    if self.ndim not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim, got {self.ndim} (in {op})")
    _check_float("multinomial", self)
    n = self.shape[-1]
    if n > 2**24:  # CPU's limit, checked before anything runs (torch checks it first)
        raise RuntimeError("number of categories cannot exceed 2^24")
    if num_samples <= 0:
        raise RuntimeError(f"cannot sample n_sample <= 0 samples (got {num_samples}, in {op})")
    if not replacement and num_samples > n:
        raise RuntimeError(
            f"cannot sample n_sample > prob_dist.size(-1) samples without "
            f"replacement (n_sample={num_samples}, size={n}, in {op})"
        )
    w = jnp.atleast_2d(self).astype(jnp.float64 if self.dtype == jnp.float64 else jnp.float32)
    # Without replacement, or for one sample, every torch backend reads these checks back
    # at the op (ATen's device-generic path), with these texts; CUDA's kernel for the
    # rest asserts on the device, so there they wait for the next sync, naming the op
    # and the first bad weight or row sum (Note [Device-side checks]).
    at_op = not replacement or num_samples == 1
    suffix = "" if at_op else f" (in {op}: got {{value}})"
    bad = ~jnp.isfinite(w) | (w < 0)
    _checks.require(
        jnp.any(bad),
        w.reshape(-1)[jnp.argmax(bad.reshape(-1))],
        RuntimeError,
        "probability tensor contains either `inf`, `nan` or element < 0" + suffix,
        deferred=not at_op,
    )
    sums = jnp.sum(w, axis=-1)
    _checks.require(
        jnp.any(sums <= 0),
        sums[jnp.argmax(sums <= 0)],
        RuntimeError,
        "invalid multinomial distribution (sum of probabilities <= 0)" + suffix,
        deferred=not at_op,
    )
    logits = jnp.log(w)
    key = _key(self)
    if replacement:
        idx = jax.random.categorical(
            key, logits[:, None, :], axis=-1, shape=(w.shape[0], num_samples)
        )
    else:
        g = jax.random.gumbel(key, w.shape, dtype=w.dtype)
        _, idx = lax.top_k(logits + g, num_samples)
    idx = idx.astype(jnp.int64)
    return idx[0] if self.ndim == 1 else idx
