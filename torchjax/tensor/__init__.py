"""JaxTensor (a torch.Tensor holding a jax.Array), its storage, dtypes and RNG state."""

from torchjax.tensor._tensor import JaxTensor, wrap

__all__ = ["JaxTensor", "wrap"]
