"""Crossing between torch tensors on "tpu" and jax arrays (zero copy)."""

from __future__ import annotations

import jax
import torch

from torchjax.tensor._tensor import JaxTensor, wrap


def to_jax(t: torch.Tensor) -> jax.Array:
    """The jax.Array behind a tpu tensor (no copy). CPU tensors are moved first.

    Raises TypeError for anything that is not a torch.Tensor.
    """
    if isinstance(t, JaxTensor):
        return t._value()
    if isinstance(t, torch.Tensor):
        return t.to("tpu")._value()
    raise TypeError(f"torchjax.to_jax expects a torch.Tensor, got {type(t).__name__}")


def from_jax(arr: jax.Array) -> JaxTensor:
    """A tpu tensor holding ``arr`` (no copy); dtype and shape are ``arr``'s."""
    if not isinstance(arr, jax.Array):
        raise TypeError(f"torchjax.from_jax expects a jax.Array, got {type(arr).__name__}")
    return wrap(arr)
