"""Pallas kernels as PyTorch ops.

- :func:`op`: register a JAX function or Pallas kernel as a ``torch.library`` op on
  tpu tensors (eager, ``torchjax.jit``, ``torch.compile(backend="tpu")``, autograd).
- Flash attention: :func:`flash_attention` (``torch.ops.torchjax.flash_attention``),
  used by ``F.scaled_dot_product_attention`` where Note [SDPA dispatch rule] allows;
  :class:`use_flash_attention` turns it on/off.
- SDPA's math fallback: :func:`exact_sdpa` (``torch.ops.torchjax.exact_attention``, the
  jax function :func:`exact_attention`), chosen by ``MATH_BY_PLATFORM`` (TPU) or
  :class:`use_math_attention` (Note [SDPA math by platform]).
- Decode attention: :func:`decode_attention` (``torch.ops.torchjax.decode_attention``)
  and :func:`paged_decode_attention`, 1-16 new tokens over a static or paged KV cache;
  SDPA takes it for such calls under the same switch (:func:`decode_applies`).
- :func:`ragged_dot` (``torch.ops.torchjax.ragged_dot``): grouped matmul for MoE.
- Tokamax: ``tokamax_ragged_dot``, ``tokamax_attention``.
- ``kernels``: the jax-level kernels and their jnp references (``torchjax.pallas.kernels``).
"""

from torchjax.pallas import kernels as kernels
from torchjax.pallas._decode_sdpa import decode_applies as decode_applies
from torchjax.pallas._decode_sdpa import decode_attention as decode_attention
from torchjax.pallas._decode_sdpa import paged_decode_attention as paged_decode_attention
from torchjax.pallas._op import KernelOp as KernelOp
from torchjax.pallas._op import interpret_default as interpret_default
from torchjax.pallas._op import op as op
from torchjax.pallas._ragged_op import ragged_dot as ragged_dot
from torchjax.pallas._sdpa import ENV_VAR as FLASH_ATTENTION_ENV_VAR
from torchjax.pallas._sdpa import flash_applies as flash_applies
from torchjax.pallas._sdpa import flash_attention as flash_attention
from torchjax.pallas._sdpa import flash_enabled as flash_enabled
from torchjax.pallas._sdpa import use_flash_attention as use_flash_attention
from torchjax.pallas._sdpa_math import ENV_VAR as SDPA_MATH_ENV_VAR
from torchjax.pallas._sdpa_math import MATH_BY_PLATFORM as MATH_BY_PLATFORM
from torchjax.pallas._sdpa_math import exact_attention as exact_attention
from torchjax.pallas._sdpa_math import exact_sdpa as exact_sdpa
from torchjax.pallas._sdpa_math import use_math_attention as use_math_attention
from torchjax.pallas._tokamax import tokamax_attention as tokamax_attention
from torchjax.pallas._tokamax import tokamax_ragged_dot as tokamax_ragged_dot

__all__ = [
    "FLASH_ATTENTION_ENV_VAR",
    "KernelOp",
    "MATH_BY_PLATFORM",
    "SDPA_MATH_ENV_VAR",
    "decode_applies",
    "decode_attention",
    "exact_attention",
    "exact_sdpa",
    "flash_applies",
    "flash_attention",
    "flash_enabled",
    "interpret_default",
    "kernels",
    "op",
    "paged_decode_attention",
    "ragged_dot",
    "tokamax_attention",
    "tokamax_ragged_dot",
    "use_flash_attention",
    "use_math_attention",
]
