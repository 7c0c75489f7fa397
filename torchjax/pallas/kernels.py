"""The jax-level kernels (jax arrays in and out) and their jnp references."""

from torchjax.pallas._decode import decode_attention as decode_attention
from torchjax.pallas._decode import decode_attention_reference as decode_attention_reference
from torchjax.pallas._decode import paged_decode_attention as paged_decode_attention
from torchjax.pallas._decode import (
    paged_decode_attention_reference as paged_decode_attention_reference,
)
from torchjax.pallas._flash import attention_reference as attention_reference
from torchjax.pallas._flash import flash_attention as flash_attention
from torchjax.pallas._ragged import ragged_dot as ragged_dot
from torchjax.pallas._ragged import ragged_dot_reference as ragged_dot_reference

__all__ = [
    "attention_reference",
    "decode_attention",
    "decode_attention_reference",
    "flash_attention",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_dot",
    "ragged_dot_reference",
]
