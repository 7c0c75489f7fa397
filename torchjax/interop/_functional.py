"""PyTorch modules as pure JAX functions: ``params, apply = torchjax.functional(module)``.

``apply(params, *args)`` binds the arrays of ``params`` into the module's parameter and
buffer storages for one call (torchjax/tensor/_binding.py), runs the module's forward on
tpu tensors wrapping the (possibly traced) jax inputs, and returns jax arrays. Nothing
else about the module is read from outside, so ``jax.jit``, ``jax.grad``,
``jax.value_and_grad`` and ``jax.vmap`` treat it as any JAX function; gradients come
from JAX's autodiff of the lowered ops, not from torch autograd (the forward runs under
``torch.no_grad()``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import pytree
from torchjax.interop._convert import from_jax
from torchjax.tensor import random as _rng
from torchjax.tensor._binding import bound, trace_lock
from torchjax.tensor._tensor import JaxTensor


def _module_state(module: torch.nn.Module, buffers: bool):
    """(names, tensors): parameters then buffers, each storage once (first name wins)."""
    names, tensors, seen = [], [], set()
    items = list(module.named_parameters(remove_duplicate=False))
    if buffers:
        items += list(module.named_buffers(remove_duplicate=False))
    for name, t in items:
        if not isinstance(t, JaxTensor):
            raise ValueError(
                f"torchjax.functional: {name} is on {t.device}; move the module with "
                ".to('tpu') first"
            )
        if id(t._storage) in seen:
            continue
        s = t._storage
        if t._offset != 0 or tuple(t.shape) != s.shape or not t.is_contiguous():
            raise ValueError(
                f"torchjax.functional: {name} is a strided view of a larger tensor; "
                "parameters and buffers must own their storage"
            )
        seen.add(id(s))
        names.append(name)
        tensors.append(t)
    return names, tensors


def functional(module: torch.nn.Module, *, buffers: bool = True, mutable: bool = False):
    """A tpu module as ``(params, apply)`` for JAX transformations.

    Args:
        module: an ``nn.Module`` on "tpu".
        buffers: include buffers (BatchNorm statistics, rotary tables) in ``params``.
        mutable: ``apply`` also returns the entries of ``params`` the forward wrote
            (BatchNorm running statistics in train mode); otherwise such writes are
            discarded and the module is left unchanged.

    Returns:
        ``params``: a dict from parameter/buffer name to jax.Array (each shared tensor
        once, under its first name, so tied weights appear once); ``apply(params, *args,
        key=None, **kwargs)``: a pure function returning the module's output with every
        tensor as a jax.Array (tuples, dicts and HF ``ModelOutput`` become the same
        structure as Python containers), plus the written state when ``mutable``. jax
        arrays in ``args``/``kwargs`` become tpu tensors; ``key`` (a jax PRNG key) feeds
        random ops (dropout) inside the forward, otherwise they draw from torch's tpu RNG
        at trace time.

    Raises:
        ValueError: a parameter or buffer is not on "tpu", or is a view of another.
    """
    names, tensors = _module_state(module, buffers)
    storages = [t._storage for t in tensors]
    params = {n: t._value() for n, t in zip(names, tensors)}

    def apply(params, *args, key=None, **kwargs):
        arrays = [params[n] for n in names]
        to_tensor = lambda x: (  # noqa: E731
            from_jax(jnp.asarray(x)) if isinstance(x, (jax.Array, np.ndarray)) else x
        )
        args, kwargs = jax.tree_util.tree_map(to_tensor, (args, kwargs))
        stream = _rng.TracedStream(key) if key is not None else None
        with trace_lock, bound(storages, arrays), torch.no_grad():
            old = _rng.set_traced_stream(stream) if stream is not None else None
            try:
                out = module(*args, **kwargs)
            finally:
                if stream is not None:
                    _rng.set_traced_stream(old)
            out = _to_arrays(out)
            if not mutable:
                return out
            written = {n: s.arr for n, s, a in zip(names, storages, arrays) if s.arr is not a}
            return out, written

    return params, apply


def _to_arrays(out):
    """Tensors -> jax arrays over a torch pytree; containers become plain tuples, lists
    and dicts (an HF ModelOutput becomes a dict), which every JAX transform accepts."""
    leaves, spec = pytree.tree_flatten(out)
    leaves = [x._value() if isinstance(x, JaxTensor) else x for x in leaves]
    return _plain(pytree.tree_unflatten(leaves, spec))


def _plain(x):
    if isinstance(x, dict):  # includes OrderedDict subclasses such as ModelOutput
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_plain(v) for v in x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x
