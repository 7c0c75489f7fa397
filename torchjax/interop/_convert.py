"""Crossing between torch tensors on "tpu" and jax arrays, without copies.

A tpu tensor that covers its whole storage (any freshly computed tensor, a parameter)
*is* its jax.Array: ``to_jax`` returns that very array and ``from_jax`` wraps an array
without touching its buffer, so both are O(1) whatever the size. A strided view of part
of a storage (``x[:, 1]``, ``x.T``) has no buffer of its own in JAX, which cannot alias
sub-buffers: ``to_jax`` of such a view returns a new array holding its elements.
"""

from __future__ import annotations

import jax
import torch

from torchjax._compat.torch import pytree
from torchjax.tensor._shared_arrays import remember
from torchjax.tensor._tensor import JaxTensor, wrap


def to_jax(t: torch.Tensor) -> jax.Array:
    """The jax.Array behind a tpu tensor.

    Args:
        t: a tpu tensor (returned without copying when it covers its storage) or a CPU
            tensor (moved to tpu:0 with one host-to-device transfer).

    Returns:
        a jax.Array of ``t``'s shape and dtype (64-bit dtypes kept; sharding kept).

    Raises:
        TypeError: ``t`` is not a torch.Tensor.
    """
    # The caller may keep it under another name: never donated (Note [Arrays shared
    # with JAX code are not donated]).
    return remember(array_of(t))


def array_of(t: torch.Tensor) -> jax.Array:
    """``to_jax`` for torchjax's own calls into JAX functions, which hold the array only
    while they run: not remembered as shared."""
    if isinstance(t, JaxTensor):
        return t._value()
    if isinstance(t, torch.Tensor):
        return t.detach().to("tpu")._value()
    raise TypeError(f"torchjax.to_jax expects a torch.Tensor, got {type(t).__name__}")


def from_jax(arr: jax.Array) -> JaxTensor:
    """A tpu tensor holding ``arr`` itself (no copy): same shape, dtype and sharding.

    ``arr`` may be a tracer (inside jax.jit / grad / vmap): the tensor then holds it, and
    torch ops on it build the traced computation.

    Raises:
        TypeError: ``arr`` is not a jax.Array.
    """
    if not isinstance(arr, jax.Array):
        raise TypeError(f"torchjax.from_jax expects a jax.Array, got {type(arr).__name__}")
    return wrap(remember(arr))


def tree_to_jax(tree):
    """``to_jax`` on every tensor leaf of a (torch) pytree; other leaves kept."""
    return pytree.tree_map(lambda x: to_jax(x) if isinstance(x, torch.Tensor) else x, tree)


def tree_from_jax(tree):
    """``from_jax`` on every jax.Array leaf of a (jax) pytree; other leaves kept."""
    return jax.tree_util.tree_map(lambda x: from_jax(x) if isinstance(x, jax.Array) else x, tree)
