"""A user's Pallas kernel written for JAX's default 32-bit mode, shared by the tests of
``torchjax.pallas.op``: a grid, an index map returning a Python 0, a ``fori_loop`` over
Python bounds (both int64 under x64, which Mosaic refuses), and a Pallas backward kernel
that an outer ``jax.vjp`` traces when it applies the pullback, after the op's call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchjax import pallas as tp


def _kernel(x_ref, o_ref):
    def body(i, acc):
        return acc + x_ref[...] * 0.5

    o_ref[...] = jax.lax.fori_loop(0, 2, body, jnp.zeros(o_ref.shape, o_ref.dtype))


def identity(interpret: bool | None = None):
    """``x -> x`` (rows a multiple of 8, 128 columns) through the kernel, forward and
    backward; ``interpret`` None: Pallas interpret mode where jax's backend is neither
    TPU nor GPU, decided at each call."""

    def scaled(x):
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            _kernel,
            grid=(x.shape[0] // 8,),
            in_specs=[spec],
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=tp.interpret_default() if interpret is None else interpret,
        )(x)

    @jax.custom_vjp
    def fn(x):
        return scaled(x)

    fn.defvjp(lambda x: (scaled(x), None), lambda _, g: (scaled(g),))
    return fn
