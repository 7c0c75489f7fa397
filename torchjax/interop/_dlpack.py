"""DLPack for tpu tensors: export through the jax array, import onto "tpu".

``torch.from_dlpack(t)`` and ``jax.dlpack.from_dlpack(t)`` of a tpu tensor use
``JaxTensor.__dlpack__`` (the jax array's protocol: zero copy for CPU arrays).
``torch.utils.dlpack.to_dlpack(t)`` is routed here (see ``install_to_dlpack``).
``torchjax.from_dlpack(x)`` makes a tpu tensor from any DLPack producer (a CPU torch
tensor, a NumPy array, a jax array) through ``jax.dlpack.from_dlpack``.
"""

from __future__ import annotations

import jax.dlpack

from torchjax._compat.torch import install_to_dlpack
from torchjax.interop._convert import from_jax
from torchjax.tensor._tensor import JaxTensor


def _export(tensor):
    if isinstance(tensor, JaxTensor):
        return tensor._value().__dlpack__()
    return None


def from_dlpack(x) -> JaxTensor:
    """A tpu tensor over the memory of DLPack producer ``x`` (zero copy when JAX can
    alias it on the default device, e.g. a contiguous CPU buffer on a CPU backend; else
    one transfer).

    Raises:
        TypeError / RuntimeError from ``jax.dlpack.from_dlpack`` for producers jax cannot
        read (e.g. a device JAX does not know).
    """
    return from_jax(jax.dlpack.from_dlpack(x))


install_to_dlpack(_export)
