"""Tokamax kernels as torch ops: ``torch.ops.torchjax.tokamax_ragged_dot`` and
``torch.ops.torchjax.tokamax_attention``, alternatives to torchjax's own kernels.

Tokamax (0.0.12, the last release for Python 3.11) picks an implementation per platform:
its Pallas kernels ("mosaic" for TPU, "triton" for GPU; "cudnn" for attention) raise
``NotImplementedError: Not supported on cpu.`` on CPU, and have no interpret mode, so on
CPU these ops run tokamax's "xla" implementation (what ``implementation=None`` selects
there). ``tokamax`` is imported on first call, not with torchjax.

Tokamax reads its config from absl flags and, the first time, parses ``sys.argv`` for
them: any program with its own command-line options (pytest's ``-p``, a training
script's ``--lr``) then dies in ``UnrecognizedFlagError``. When nothing has parsed absl
flags yet, :func:`_tokamax` marks them parsed (defaults) before tokamax reads them;
tokamax's own config context managers still change them.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from torchjax.pallas._jax_mode import in_32bit_mode
from torchjax.pallas._op import op
from torchjax.pallas._tiling import precision_of


def _tokamax():
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


# Note [A kernel op's JAX mode]: tokamax's kernels are written for JAX's 32-bit mode. The
# ops take torch's int64 group sizes (x64=True), cast them (exact: a count of rows), and
# run tokamax's function, forward and backward, in 32-bit mode.


@op("torchjax::tokamax_ragged_dot", x64=True)
def tokamax_ragged_dot(lhs, rhs, group_sizes):
    """``tokamax.ragged_dot``: lhs (M, K), rhs (G, K, N), group_sizes (G,) int ->
    (M, N) in lhs's dtype (``jax.lax.ragged_dot`` semantics). Differentiable in lhs and
    rhs (tokamax's own VJP)."""
    sizes = group_sizes.astype(jnp.int32)
    # float32 at full precision, as torch's default and torchjax's kernels (Note [Kernel
    # matmul precision]); tokamax's TPU kernel otherwise takes one bfloat16 pass.
    precision = precision_of(lhs, rhs)
    return in_32bit_mode(functools.partial(_tokamax().ragged_dot, precision=precision))(
        lhs, rhs, sizes
    )


@op(
    "torchjax::tokamax_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, "
    "float? scale=None) -> Tensor",
    x64=True,
)
def tokamax_attention(q, k, v, mask=None, causal=False, scale=None):
    """``tokamax.dot_product_attention`` in torch's layout: q (B, Hq, Sq, D), k/v
    (B, Hkv, Sk, D) (GQA by head grouping), mask bool (True = attend) or float (added),
    broadcastable to (B, Hq, Sq, Sk) -> (B, Hq, Sq, D). Tokamax takes (B, S, H, D), so
    the wrapper transposes in and out (inside the same jax program)."""
    tokamax = _tokamax()

    def bshd(x):
        return jnp.swapaxes(x, 1, 2)

    bias = None
    if mask is not None and mask.dtype != jnp.bool_:
        bias, mask = mask, None
    precision = precision_of(q, k)
    # tokamax's TPU kernel ignores ``precision``; its products follow the default
    # (Note [Kernel matmul precision]).
    attention = in_32bit_mode(
        functools.partial(
            tokamax.dot_product_attention, scale=scale, is_causal=causal, precision=precision
        ),
        matmul_precision=None if precision is None else "highest",
    )
    out = attention(bshd(q), bshd(k), bshd(v), bias=bias, mask=mask)
    return bshd(out)
