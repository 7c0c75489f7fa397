"""ATen -> jax lowerings, one module per op family, all registered into ops/registry.py."""

from torchjax.ops import copy as _copy  # noqa: F401
from torchjax.ops.registry import handler, lowering, register_pointwise

__all__ = ["handler", "lowering", "register_pointwise"]
