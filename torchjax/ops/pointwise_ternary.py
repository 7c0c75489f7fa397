"""Elementwise ops of three tensors: ``lerp``, ``addcmul``, ``addcdiv``, and ``fma``, the
multiply-add rounded once that they (and the fused optimizers) compute as CPU's vectorised
loops do, so an optimizer's state matches CPU's bit for bit.

Inputs arrive promoted to torch's computation dtype (``promote=``; lerp does not
promote, as torch); the operands broadcast with pointwise_binary.py's ``bcast``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops import writeback
from torchjax.ops.pointwise_binary import (
    add_values,
    bcast,
    exact_div,
    fma,
    integral,
    kind_of,
    mul_values,
    require_kind,
    scale_by,
)
from torchjax.ops.registry import Kind, lowering, precheck
from torchjax.ops.schema import arg
from torchjax.tensor import dtypes

aten = torch.ops.aten


def _type_meta_name(x) -> str:
    return writeback.dtype_name(dtypes.to_torch_dtype(x.dtype))


@lowering(aten.lerp)
def lerp(self, end, weight):
    """aten::lerp - ``self + weight * (end - self)``, evaluated from the nearer end as
    torch does (``end - (end - self) * (1 - weight)`` when |weight| >= 0.5), each form
    one FMA for real floats as CPU's vectorised kernel computes it (an optimizer's
    ``exp_avg.lerp_`` then matches CPU's bit for bit). Floating and complex only: a
    Python weight does not promote integer inputs (torch raises)."""
    require_kind("lerp", self, ("float", "complex"))
    # torch does not promote: ``end`` and a weight tensor of more than one element must
    # have self's dtype. Half types compute in float32, as ATen's opmath.
    for name, other in (("end", end), ("weight", weight)):
        if (
            isinstance(other, jax.Array)
            and (name == "end" or other.ndim)
            and other.dtype != self.dtype
        ):
            raise RuntimeError(
                f"aten::lerp: expected dtype {_type_meta_name(self)} for `{name}` "
                f"but got dtype {_type_meta_name(other)}"
            )
    result = self.dtype
    compute = jnp.promote_types(result, jnp.float32)
    a, b, w = bcast(self.astype(compute), end.astype(compute), jnp.asarray(weight).astype(compute))
    diff = b - a
    one = jnp.ones((), w.dtype)
    small = jnp.abs(w) < np.asarray(0.5, a.real.dtype)
    if kind_of(a) == "float":
        return jnp.where(small, fma(w, diff, a), fma(w - one, diff, b)).astype(result)
    return jnp.where(small, a + w * diff, b - diff * (one - w)).astype(result)


@lowering(aten.addcmul, promote=Kind.DEFAULT, promote_args=("self", "tensor1", "tensor2"))
def addcmul(self, tensor1, tensor2, *, value=1):
    """aten::addcmul - ``self + value * tensor1 * tensor2``. Shapes: broadcast. The
    products are taken in CPU's order, ``(value * tensor1) * tensor2``, and float32 adds
    that last product to ``self`` in one FMA as CPU's vectorised loop does (``fma``), so
    an optimizer's moments match CPU's bit for bit. An integer computation reads a float
    ``value`` as its integer type (truncated), as CPU's kernel does."""
    if kind_of(self) == "bool":
        raise NotImplementedError("\"addcmul_cpu_out\" not implemented for 'Bool'")
    if isinstance(value, float) and kind_of(tensor1) == "int":
        dtypes.check_scalar_fits(value, tensor1.dtype, "addcmul")
        value = int(value)
    scaled = scale_by("addcmul", tensor1, value, value_check=True)
    if kind_of(self) == "float" and jnp.result_type(self, scaled, tensor2) == jnp.float32:
        return fma(*bcast(scaled, tensor2, self))
    return add_values(self, mul_values(scaled, tensor2))


_ADDCDIV_INTEGER = (
    "Integer division with addcdiv is no longer supported, and in a future  release addcdiv "
    "will perform a true division of tensor1 and tensor2. The historic addcdiv behavior can "
    "be implemented as (input + value * torch.trunc(tensor1 / tensor2)).to(input.dtype) for "
    "integer inputs and as (input + value * tensor1 / tensor2) for float inputs. The future "
    "addcdiv behavior is just the latter implementation: (input + value * tensor1 / tensor2), "
    "for all dtypes."
)


@precheck(aten.addcdiv)
def _addcdiv_integer_division(args, kwargs) -> None:
    """ATen refuses integer (or bool) ``tensor1`` and ``tensor2`` whatever ``self`` is,
    before any promotion (PointwiseOps.cpp, CPU's text word for word, the double space
    included): checked on the torch dtypes, since promotion would make them float."""
    t1 = arg(args, kwargs, 1, "tensor1")
    t2 = arg(args, kwargs, 2, "tensor2")
    if integral(t1) and integral(t2):
        raise RuntimeError(_ADDCDIV_INTEGER)


@lowering(aten.addcdiv, promote=Kind.DEFAULT, promote_args=("self", "tensor1", "tensor2"))
def addcdiv(self, tensor1, tensor2, *, value=1):
    """aten::addcdiv - ``self + value * tensor1 / tensor2``; integer ``tensor1`` and
    ``tensor2`` are refused before promotion (``_addcdiv_integer_division``)."""
    # CPU's order: (value * tensor1) / tensor2, then the sum.
    scaled = scale_by("addcdiv", tensor1, value, value_check=True)
    return add_values(self, exact_div(scaled, tensor2))
