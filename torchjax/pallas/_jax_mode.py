"""A JAX function run in JAX's 32-bit mode, forward and backward, under torchjax's x64.

Note [A kernel op's JAX mode]
torchjax runs its ops with JAX's x64 on (Note [x64 without touching the user's JAX]), but
a Pallas kernel is written for JAX's default 32-bit mode, and Mosaic refuses the 64-bit
integers x64 makes of its index maps' Python ints and loop bounds. So an op runs its
function in 32-bit mode unless it is registered with ``x64=True``: the forward trace, the
fake implementation's ``eval_shape``, and every backward, including the pullback that an
outer ``jax.vjp`` (``torchjax.jit`` and ``torch.compile`` training) applies long after the
call returned: the function is wrapped in a ``jax.custom_vjp`` whose forward and backward
each enter 32-bit mode, so a ``custom_vjp`` backward of the user's (a Pallas backward
kernel) is traced in that mode too. In that mode JAX would truncate a 64-bit input
(int64 values past 2**31 wrap, float64 rounds to float32). torch's integer default is
int64, and a model hands a kernel int64 indices (transformers' ``top_k_index``), so an
int64 (uint64) argument is narrowed to int32 (uint32) before the function sees it, with a
device-side check (Note [Device-side checks]) that every value survives: one past 2**31
raises a RuntimeError naming the op, its argument and the value at the next
synchronisation, as an index out of range does, not a wrapped number (as with every
device check; inside ``torchjax.jit`` and ``torch.compile`` after the call, while an
eager call keeping its backward makes it inside ``jax.vjp``, where it is not checked).
Integer arithmetic inside the function is JAX's 32-bit arithmetic too: its integer
outputs are int32 and wrap at 2**31, as the function would in JAX; a Python int
argument past the int32 range is refused (TypeError).
A float64 or complex128 argument is refused with a TypeError naming it and the two ways
out (cast it, or register the op with ``x64=True``): a float narrowed would round
silently. torchjax's own kernel ops are registered with ``x64=True`` and trace each
``pallas_call`` in 32-bit mode themselves (Note [Kernels trace in 32-bit mode] in
torchjax/pallas/_tiling.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from torchjax.device import _checks

_NARROW_INTS = {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32}


def _narrowed(x, where: str, arg: str):
    """An int64/uint64 array as int32/uint32, with a device-side check that no value
    changed (Note [A kernel op's JAX mode]); any other array as it is."""
    narrow = _NARROW_INTS.get(np.dtype(x.dtype)) if hasattr(x, "dtype") else None
    if narrow is None:
        return x
    with jax.enable_x64(True):
        small = x.astype(narrow)
        if x.size:
            lost = (small.astype(x.dtype) != x).reshape(-1)
            value = x.reshape(-1)[jnp.argmax(lost)]
            _checks.require(
                jnp.any(lost),
                value,
                RuntimeError,
                f"{where}: value {{value}} of the {x.dtype} argument {arg!r} does not fit the "
                f"{np.dtype(narrow)} the op's JAX function runs in (JAX's default 32-bit "
                "mode); register the op with torchjax.pallas.op(..., x64=True)",
            )
    return small


def _arg_name(fn, path) -> str:
    """The parameter of ``fn`` a leaf of ``(args, kwargs)`` at ``path`` belongs to."""
    group, key = path[0].idx, path[1]
    if group == 1:
        return str(key.key)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or partial without a signature
        params = []
    return params[key.idx] if key.idx < len(params) else f"argument {key.idx}"


def in_32bit_mode(fn, name: str | None = None, matmul_precision: str | None = None):
    """``fn`` run in JAX's 32-bit mode, forward and backward (Note [A kernel op's JAX
    mode]): non-array arguments are bound as they are; int64 arrays arrive as int32
    (checked on the device; ``name`` names the caller in that error); the arrays go
    through a ``jax.custom_vjp`` whose rules enter the mode, so the pullback does
    wherever it is applied. ``matmul_precision`` (a ``jax.default_matmul_precision``
    value) is entered the same way, for a third-party kernel whose products take no
    precision argument (Note [Kernel matmul precision])."""
    where_name = name or getattr(fn, "__name__", "torchjax.pallas.op")

    @contextlib.contextmanager
    def mode():
        with jax.enable_x64(False), jax.default_matmul_precision(matmul_precision):
            yield

    @functools.wraps(fn)
    def run(*args, **kwargs):
        paths, spec = jax.tree_util.tree_flatten_with_path((args, kwargs))
        flat = [leaf for _, leaf in paths]
        where = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, jax.core.Tracer))]
        for i in where:
            flat[i] = _narrowed(flat[i], where_name, _arg_name(fn, paths[i][0]))

        def call(*arrays):
            full = list(flat)
            for i, a in zip(where, arrays):
                full[i] = a
            a, k = jax.tree_util.tree_unflatten(spec, full)
            with mode():
                return fn(*a, **k)

        @jax.custom_vjp
        def g(*arrays):
            return call(*arrays)

        def g_fwd(*arrays):
            with mode():
                return jax.vjp(call, *arrays)

        def g_bwd(pullback, cotangents):
            with mode():
                return pullback(cotangents)

        g.defvjp(g_fwd, g_bwd)
        return g(*(flat[i] for i in where))

    return run
