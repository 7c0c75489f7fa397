"""The jax-level kernels (jax arrays in and out) and their jnp references."""

from torchjax.pallas._flash import attention_reference as attention_reference
from torchjax.pallas._flash import flash_attention as flash_attention
from torchjax.pallas._ragged import ragged_dot as ragged_dot
from torchjax.pallas._ragged import ragged_dot_reference as ragged_dot_reference

__all__ = ["attention_reference", "flash_attention", "ragged_dot", "ragged_dot_reference"]
