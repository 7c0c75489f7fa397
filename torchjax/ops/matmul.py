"""Matrix products: mm, bmm, mv, dot and their fused add forms, lowered to ``lax.dot_general``.

``matmul``, ``linear``, ``einsum``, ``outer``, ``tensordot`` are CompositeImplicitAutograd in
torch: they reach us as views plus ``mm``/``bmm``/``mv``/``dot``/``addmm`` (and ``mul`` for
``outer``), so only the primitives below are lowered.

Precision (Note [Matmul precision]): float32 and complex64 products follow torch's own knob,
``torch.get_float32_matmul_precision()`` (which ``torch.backends.cuda.matmul.allow_tf32``
also sets): "highest" (the default) -> ``lax.Precision.HIGHEST``, "high" ->
``Precision.HIGH`` (bf16x3 passes on TPU, TF32 on GPU), "medium" -> ``Precision.DEFAULT``
(one bf16 pass on TPU). Other dtypes always use HIGHEST. On CPU all three give the same
values; on GPU/TPU only "highest" matches CPU torch to float32 tolerance. The knob is read
on every call (one C call, ~0.3 us): each product overload has one registry handler per
precision, each with its own compiled executables, and ``precision_lowering`` registers a
handler that picks one, so a trace never bakes in a stale precision. Convolutions
(torchjax/ops/conv.py) follow the same knob.

Accumulation: float16/bfloat16 products accumulate in float32
(``preferred_element_type``) and round once at the end, as ATen's CPU and CUDA kernels do;
the ``beta * self`` term of the add forms is added in float32 before that rounding.
Integer products accumulate in their own dtype (wrapping on overflow, as torch does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import matmul_checks
from torchjax.ops.registry import functional_handler, handler, lowering
from torchjax.ops.writeback import write_into
from torchjax.tensor._storage import Storage, contiguous_strides

aten = torch.ops.aten

HIGHEST = lax.Precision.HIGHEST

# torch.get_float32_matmul_precision() -> lax precision (Note [Matmul precision]).
PRECISIONS = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "medium": lax.Precision.DEFAULT,
}
_KNOB_DTYPES = (jnp.float32, jnp.complex64)


def matmul_precision() -> lax.Precision:
    """The lax precision of float32 products under torch's current
    ``torch.get_float32_matmul_precision()`` (Note [Matmul precision])."""
    return PRECISIONS[torch.get_float32_matmul_precision()]


def precision_for(dtype, precision) -> lax.Precision:
    """``precision`` for float32/complex64 operands; HIGHEST for every other dtype (torch's
    knob is about float32 only)."""
    return precision if dtype in _KNOB_DTYPES else HIGHEST


def precision_lowering(*ops):
    """``@lowering`` for a product whose body takes a keyword ``precision`` (a
    ``lax.Precision``) that follows torch's knob on every call (Note [Matmul precision]).

    Each functional overload of ``ops`` gets one registry handler per precision (each with
    its own compiled executables) and a handler picking one by the knob; the registry
    derives the ``out=`` and in-place overloads from it as usual."""

    def deco(fn):
        for op in ops:
            overloads = [getattr(op, n) for n in op.overloads()]
            for ov in overloads:
                if any(a.is_out for a in ov._schema.arguments):
                    continue
                per = {
                    name: functional_handler(ov, functools.partial(fn, precision=p))
                    for name, p in PRECISIONS.items()
                }
                handler(ov)(_pick_by_knob(per))
        return fn

    return deco


def _pick_by_knob(per):
    knob = torch.get_float32_matmul_precision

    def product(args, kwargs):
        return per[knob()](args, kwargs)

    return product


def _acc_dtype(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _dot(a: jax.Array, b: jax.Array, contract, batch=((), ()), precision=HIGHEST) -> jax.Array:
    """``lax.dot_general`` accumulating in the opmath dtype; ``precision`` applies to
    float32/complex64 operands, other dtypes use HIGHEST."""
    return accumulating_dot(a, b, (contract, batch), precision_for(a.dtype, precision))


# Note [Half-precision products on CPU]
# A float16/bfloat16 product accumulates in float32 (``preferred_element_type``), as
# ATen's kernels do. XLA:CPU compiles such a dot_general to a slow loop: a (1, 256) x
# (256, 512) bfloat16 product took 30 us, against 3.8 us for the same product of the
# operands cast to float32 first, which computes the same thing (each product of two
# half-precision numbers is exact in float32, the sum is accumulated in float32 at
# HIGHEST precision). So on CPU the operands are cast up; on TPU and GPU, whose matrix
# units take half-precision operands with float32 accumulation natively (a float32 dot
# would take several passes there), the dot keeps its half-precision operands.
def accumulating_dot(a: jax.Array, b: jax.Array, dims, precision) -> jax.Array:
    """``lax.dot_general(a, b, dims)`` accumulating and returning in the opmath dtype
    (float32 for float16/bfloat16 operands: Note [Half-precision products on CPU])."""
    acc = _acc_dtype(a.dtype)
    if acc == a.dtype:
        return lax.dot_general(a, b, dims, precision=precision)

    def native(a, b):
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)

    def cast_up(a, b):
        return lax.dot_general(a.astype(acc), b.astype(acc), dims, precision=precision)

    return lax.platform_dependent(a, b, cpu=cast_up, default=native)


def _check_dtypes(name, *arrs):
    dts = {a.dtype for a in arrs if a is not None}
    if np.dtype(np.bool_) in dts:
        # CPU has no bool kernel for the matrix products (CUDA neither).
        raise NotImplementedError(f"\"{name}\" not implemented for 'Bool'")
    if len(dts) > 1:
        got = ", ".join(str(a.dtype) for a in arrs if a is not None)
        raise RuntimeError(
            f"aten::{name}: expected all operands to have the same dtype, got {got}; "
            "cast them with .to(dtype) first"
        )


# The dtypes CPU's addmm/addbmm (gemm) and addmv (gemv) hand to BLAS.
_GEMM = frozenset(map(np.dtype, (np.float32, np.float64, np.complex64, np.complex128)))
_GEMV = frozenset(map(np.dtype, (np.float32, np.float64)))


def _add_scaled(product, self, beta, alpha, out_dtype, blas=frozenset()):
    """``beta * self + alpha * product`` with torch's rules: beta == 0 ignores self
    (NaN/inf in self do not propagate); for integer dtypes alpha and beta are first
    converted to the integer type (truncated), as ATen's ``Scalar.to<int64_t>()``.
    ``blas``: the dtypes in which CPU computes the op with a BLAS gemm/gemv (addmm and
    addbmm in float32, float64 and complex; addmv in float32 and float64), which skips
    the product when alpha == 0, so NaN/inf in the matrices do not propagate either
    (baddbmm, addr and the other dtypes multiply and propagate them)."""
    if out_dtype == jnp.bool_:
        alpha, beta = bool(alpha), bool(beta)
    elif jnp.issubdtype(out_dtype, jnp.integer):
        alpha, beta = int(alpha), int(beta)
    if alpha == 0 and out_dtype in blas:
        product = jnp.zeros(product.shape, product.dtype)
    elif alpha != 1:
        product = product * alpha
    if beta != 0 and self is not None:
        s = self.astype(product.dtype)
        product = product + (s if beta == 1 else s * beta)
    return product.astype(out_dtype)


@precision_lowering(aten.mm)
def mm(self, mat2, *, precision=HIGHEST):
    """aten::mm - (n, k) @ (k, m) -> (n, m).

    Dtypes: both operands the same dtype (torch raises otherwise); result that dtype.
    bool: CPU has no kernel, but returns before needing one when there is nothing to
    multiply (an empty result, or k == 0: False). Reference: torch.mm; lax.dot_general."""
    matmul_checks.mm_checks(self, mat2)
    shape = (self.shape[0], mat2.shape[1])
    if matmul_checks.is_bool(self):
        if self.size and mat2.size:
            raise NotImplementedError("\"addmm_impl_cpu_\" not implemented for 'Bool'")
        return jnp.zeros(shape, self.dtype)
    return _dot(self, mat2, ((1,), (0,)), precision=precision).astype(self.dtype)


@precision_lowering(aten.bmm)
def bmm(self, mat2, *, precision=HIGHEST):
    """aten::bmm - (b, n, k) @ (b, k, m) -> (b, n, m).

    Checks in CPU's order (ops/matmul_checks.py). With an empty operand CPU's kernel
    returns zeros of batch2's dtype before it looks at the dtypes (bool, or two different
    ones, included). Reference: torch.bmm."""
    matmul_checks.bmm_checks(self, mat2)
    if not self.size or not mat2.size:
        return jnp.zeros((self.shape[0], self.shape[1], mat2.shape[2]), mat2.dtype)
    matmul_checks.bmm_kernel_checks(self, mat2)
    return _dot(self, mat2, ((2,), (1,)), ((0,), (0,)), precision=precision).astype(self.dtype)


@precision_lowering(aten.mv)
def mv(self, vec, *, precision=HIGHEST):
    """aten::mv - (n, m) @ (m,) -> (n,). Checks in CPU's order (ops/matmul_checks.py);
    a bool matrix with nothing to multiply gives zeros. Reference: torch.mv."""
    matmul_checks.mv_checks(self, vec)
    if not self.size:
        return jnp.zeros((self.shape[0],), vec.dtype)
    return _dot(self, vec, ((1,), (0,)), precision=precision).astype(self.dtype)


@precision_lowering(aten.dot)
def dot(self, tensor, *, precision=HIGHEST):
    """aten::dot - inner product of two 1-D tensors (no conjugation) -> 0-d."""
    matmul_checks.dot_checks(self, tensor)
    return _dot(self, tensor, ((0,), (0,)), precision=precision).astype(self.dtype)


@precision_lowering(aten.vdot)
def vdot(self, other, *, precision=HIGHEST):
    """aten::vdot - inner product conjugating ``self`` (complex) -> 0-d."""
    matmul_checks.dot_checks(self, other)
    return _dot(jnp.conj(self), other, ((0,), (0,)), precision=precision).astype(self.dtype)


@precision_lowering(aten.addmm)
def addmm(self, mat1, mat2, *, beta=1, alpha=1, precision=HIGHEST):
    """aten::addmm - beta * self + alpha * (mat1 @ mat2); self broadcasts to (n, m).

    beta == 0 ignores self's values (as torch). Checks in CPU's order (ops/matmul_checks.py).
    With nothing to multiply (k == 0) CPU computes ``beta * self`` alone, with torch's
    ``mul`` (alpha unread), which refuses a beta the result cannot hold: that is also what
    bool gets then, and an empty result; other bool calls have no kernel.
    Reference: torch.addmm."""
    matmul_checks.addmm_checks(self, mat1, mat2)
    matmul_checks.addmm_kernel_checks(self.dtype, mat1, mat2, beta, alpha)
    shape = (mat1.shape[0], mat2.shape[1])
    if not shape[0] * shape[1]:  # CPU reads neither beta nor alpha then
        return jnp.zeros(shape, self.dtype)
    if not mat1.shape[1]:
        scaled = _add_scaled(jnp.zeros((), self.dtype), self, beta, 1, self.dtype)
        return jnp.broadcast_to(scaled, shape)
    out = _add_scaled(
        _dot(mat1, mat2, ((1,), (0,)), precision=precision),
        self,
        beta,
        alpha,
        mat1.dtype,
        blas=_GEMM,
    )
    return jnp.broadcast_to(out, shape)


@precision_lowering(aten.addmv)
def addmv(self, mat, vec, *, beta=1, alpha=1, precision=HIGHEST):
    """aten::addmv - beta * self + alpha * (mat @ vec); self broadcasts to (n,). Checks
    in CPU's order (ops/matmul_checks.py); with nothing to multiply, beta * self."""
    matmul_checks.addmv_checks(self, mat, vec, beta, alpha)
    if not mat.size:  # CPU reads neither alpha nor the (empty) product
        scaled = _add_scaled(jnp.zeros((), _acc_dtype(vec.dtype)), self, beta, 1, vec.dtype)
        return jnp.broadcast_to(scaled, (mat.shape[0],))
    prod = _dot(mat, vec, ((1,), (0,)), precision=precision)
    out = _add_scaled(prod, self, beta, alpha, vec.dtype, blas=_GEMV)
    return jnp.broadcast_to(out, (mat.shape[0],))


@precision_lowering(aten.baddbmm)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1, precision=HIGHEST):
    """aten::baddbmm - beta * self + alpha * bmm(batch1, batch2); self broadcasts.

    Checks in CPU's order (ops/matmul_checks.py). The result has batch2's dtype; with
    nothing to multiply (k == 0, or an empty result) CPU's kernel returns before it
    looks at batch1's dtype, so that may differ then."""
    matmul_checks.baddbmm_checks(self, batch1, batch2, beta, alpha)
    shape = (batch1.shape[0], batch1.shape[1], batch2.shape[2])
    if not math.prod(shape):
        return jnp.zeros(shape, batch2.dtype)
    if not batch1.shape[2]:  # self * beta alone (alpha unread)
        zero = jnp.zeros((), _acc_dtype(batch2.dtype))
        return jnp.broadcast_to(_add_scaled(zero, self, beta, 1, batch2.dtype), shape)
    prod = _dot(batch1, batch2, ((2,), (1,)), ((0,), (0,)), precision=precision)
    out = _add_scaled(prod, self, beta, alpha, batch2.dtype)
    return jnp.broadcast_to(out, shape)


@precision_lowering(aten.addbmm)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1, precision=HIGHEST):
    """aten::addbmm - beta * self + alpha * sum_b(batch1[b] @ batch2[b]) -> (n, m).

    Checks in CPU's order (ops/matmul_checks.py). The result has self's dtype; with no
    batch CPU computes beta * self alone, and the batches' dtypes may differ then."""
    matmul_checks.addbmm_checks(self, batch1, batch2, beta, alpha)
    shape = (batch1.shape[1], batch2.shape[2])
    if not math.prod(shape):
        return jnp.zeros(shape, self.dtype)
    if not batch1.shape[0] or not batch1.shape[2]:  # self * beta alone (alpha unread)
        zero = jnp.zeros((), _acc_dtype(self.dtype))
        return jnp.broadcast_to(_add_scaled(zero, self, beta, 1, self.dtype), shape)
    if batch1.dtype in (jnp.float16, jnp.bfloat16):
        # ATen loops addmm_ over the batch, rounding to the half dtype after each step;
        # one float32 sum would be more accurate but not equal to CPU torch.
        out = jnp.broadcast_to(self, shape)
        for b in range(batch1.shape[0]):
            out = _add_scaled(
                _dot(batch1[b], batch2[b], ((1,), (0,)), precision=precision),
                out,
                beta if b == 0 else 1,
                alpha,
                batch1.dtype,
                blas=_GEMM,
            )
        return out
    # Contracting over the batch and k axes together sums the per-batch products.
    prod = _dot(batch1, batch2, ((0, 2), (0, 1)), precision=precision)
    out = _add_scaled(prod, self, beta, alpha, batch1.dtype, blas=_GEMM)
    return jnp.broadcast_to(out, shape)


@lowering(aten._trilinear)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """aten::_trilinear - sum over ``sumdim`` of i1 * i2 * i3, each first unsqueezed at
    its ``expand`` dims (what ``F.bilinear`` lowers to). ``unroll_dim`` is a CPU loop
    hint with no effect on the value. Dtypes: inputs' (equal); f16/bf16 in float32."""
    _check_dtypes("_trilinear", i1, i2, i3)
    acc = _acc_dtype(i1.dtype)
    x = [
        jnp.expand_dims(t.astype(acc), tuple(e)) if e else t.astype(acc)
        for t, e in ((i1, expand1), (i2, expand2), (i3, expand3))
    ]
    prod = (x[0] * x[1]) * x[2]
    out = jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod
    return out.astype(i1.dtype)


def _group_ends(offs, total):
    """Group index of each of ``total`` rows given cumulative group ends ``offs``."""
    return jnp.searchsorted(offs, jnp.arange(total, dtype=offs.dtype), side="right")


# Note [Grouped products of few rows]
# A MoE layer's ``_grouped_mm``, (M token-expert pairs, K) x (G experts, K, N), is a
# ``lax.ragged_dot``: on TPU one ``ragged-dot`` instruction, which XLA:TPU compiles as a
# kernel of its own. On a v5e a Qwen3-MoE layer (two such products) compiled in 5.2-5.7
# s against 0.23-0.38 s for a dense layer, and an 8-layer decode loop did not finish
# compiling in 90 s; on CPU, where ragged_dot is expanded into plain ops, the same layer
# compiles about as fast as a dense one, which points at that instruction. With no more
# rows than groups (decoding: batch x top-k pairs, 8 against 64 experts) each row is
# instead multiplied by its own group's matrix, gathered: one gather and one batched
# dot, single instructions on every backend, touching at most the matrices a ragged dot
# reads (M <= G of them). The same products, each accumulated in float32 once, so the
# values are the ragged dot's; rows past ``offs[-1]`` are selected to 0. Larger M keeps
# the ragged dot, where the gathered copy would outgrow the weights.
def _rows_by_own_group(self, mat2, offs, precision):
    """(M, K) x (G, K, N) -> (M, N), row i times the matrix of the group holding it."""
    g = mat2.shape[0]
    rows = jnp.arange(self.shape[0], dtype=offs.dtype)
    # Groups ending at or before row i: its group's index (G: past every group).
    group = jnp.sum(offs[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
    w = mat2[jnp.minimum(group, g - 1)]  # (M, K, N)
    out = _dot(self[:, None, :], w, ((2,), (1,)), ((0,), (0,)), precision=precision)[:, 0]
    return jnp.where((group < g)[:, None], out, jnp.zeros((), out.dtype))


@precision_lowering(aten._grouped_mm)
def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None, *, precision=HIGHEST):
    """aten::_grouped_mm - per-group matrix products (MoE), groups given by ``offs``.

    Shapes (``offs`` holds cumulative group ends, length G):
    2d x 3d: (M, K) x (G, K, N) -> (M, N), rows of self split into groups
    (``lax.ragged_dot``; a gathered matrix per row when M <= G: Note [Grouped products
    of few rows]); 3d x 3d: batched mm; 2d x 2d: (M, K) x (K, N) with K split ->
    (G, M, N); 3d x 2d: (G, M, K) x (K, N) with N split -> (M, N).
    Rows/columns past ``offs[-1]`` are zero. Dtypes: result ``out_dtype`` (default self's).
    Reference: torch/_meta_registrations.py (_meta_grouped_mm); lax.ragged_dot.
    """
    from torchjax.tensor.dtypes import to_jax_dtype

    result_dtype = self.dtype if out_dtype is None else to_jax_dtype(out_dtype)
    acc = jnp.float32 if self.dtype in (jnp.bfloat16, jnp.float16) else self.dtype
    if self.ndim == 3 and mat2.ndim == 3:
        out = _dot(self, mat2, ((2,), (1,)), ((0,), (0,)), precision=precision)
    elif offs is None:
        raise RuntimeError(
            f"aten::_grouped_mm: offs is required for {self.ndim}d x {mat2.ndim}d inputs"
        )
    elif self.ndim == 2 and mat2.ndim == 3 and self.shape[0] <= mat2.shape[0]:
        out = _rows_by_own_group(self, mat2, offs, precision)
    elif self.ndim == 2 and mat2.ndim == 3:
        sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype)).astype(jnp.int32)
        # ragged_dot needs sum(group_sizes) == M: rows past offs[-1] join a zero group.
        tail = (self.shape[0] - offs[-1]).astype(jnp.int32).reshape(1)
        rhs = jnp.concatenate([mat2, jnp.zeros((1,) + mat2.shape[1:], mat2.dtype)])
        # No precision for half-precision operands: on TPU ragged_dot is a Mosaic kernel,
        # which refuses HIGHEST on them (Note [Kernel matmul precision]).
        out = lax.ragged_dot(
            self,
            rhs,
            jnp.concatenate([sizes, tail]),
            precision=precision if self.dtype in _KNOB_DTYPES else None,
            preferred_element_type=acc,
        )
    elif self.ndim == 2 and mat2.ndim == 2:
        g = _group_ends(offs, self.shape[1])
        mask = (g[None, :] == jnp.arange(offs.shape[0])[:, None]).astype(acc)
        out = jnp.einsum(
            "mk,gk,kn->gmn",
            self.astype(acc),
            mask,
            mat2.astype(acc),
            precision=precision_for(self.dtype, precision),
        )
    else:
        g = _group_ends(offs, mat2.shape[1])
        full = _dot(self, mat2, ((2,), (0,)), precision=precision)  # (G, M, N)
        valid = g < offs.shape[0]
        picked = jnp.take_along_axis(
            full, jnp.minimum(g, offs.shape[0] - 1)[None, None, :], axis=0
        )[0]
        out = jnp.where(valid[None, :], picked, jnp.zeros((), acc))
    if bias is not None:
        out = out + bias.astype(acc)
    return out.astype(result_dtype)


@handler(aten.addbmm_.default)
def addbmm_(args, kwargs):
    """aten::addbmm_ - in-place addbmm. Unlike other in-place ops, ATen's kernel resizes
    ``self`` to (n, m) when it only broadcasts to it (``addbmm_out`` with out=self), so the
    result replaces self's storage then, as CPU ``resize_`` reallocating does."""
    self = args[0]
    result = aten.addbmm.default(*args, **kwargs)
    if tuple(result.shape) != tuple(self.shape):
        size = tuple(result.shape)
        self._rebind(Storage(result._value()), size, contiguous_strides(size), 0)
        return self
    return write_into(aten.addbmm_.default, self, result)
