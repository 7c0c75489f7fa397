"""ATen's range checks of ``random_(from, to)``, before any draw.

Note [random_ bounds]
``random_.from``/``random_.to`` (and ``torch.randint``, ``randint_like``, which call them)
check on every backend that ``from`` and ``to - 1`` fit the tensor's dtype
(DistributionTemplates.h, ``check_from_to_in_range``): an integer or bool dtype refuses a
bound outside its range with RuntimeError ("to - 1 is out of bounds for unsigned char"),
a floating dtype refuses one outside its finite range and warns past 2**digits, where
its integers stop being exact. Without the check ``random_(0, 300)`` of a uint8 tensor
drew values that wrapped around and ``random_(0, 5)`` of a bool tensor drew True and
False: numbers where CPU raises. The check runs as a precheck, on every call (a compiled
lowering traces once per key, so a warning there would be given once only).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import torch

from torchjax.ops.random import _FLOAT_DIGITS, _dtype_max
from torchjax.ops.registry import precheck
from torchjax.ops.schema import arg
from torchjax.ops.writeback import dtype_name
from torchjax.tensor.dtypes import to_jax_dtype

aten = torch.ops.aten


def _bounds(dtype):
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return float(info.min), float(info.max)
    if dtype == torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return info.min, info.max


def check_from_to(dtype, lo: int, to_inc: int) -> None:
    """``check_from_to_in_range`` of ATen for ``from`` = ``lo`` and ``to - 1`` = ``to_inc``."""
    if dtype.is_complex:
        return  # refused by the lowering, as CPU's kernel refuses it
    low, high = _bounds(dtype)
    name = dtype_name(dtype)
    for value, what in ((lo, "from"), (to_inc, "to - 1")):
        if not low <= value <= high:
            raise RuntimeError(f"{what} is out of bounds for {name}")
    digits = _FLOAT_DIGITS.get(jnp.dtype(to_jax_dtype(dtype)))
    if digits is None:
        return
    for value, what in ((lo, "from"), (to_inc, "to - 1")):
        if value < -(1 << digits) or value > (1 << digits):
            warnings.warn(
                f"{what} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision "
                f"limitations {name} can support discrete uniform distribution only within "
                "this range. This warning will become an error in version 1.7 release, "
                "please fix the code in advance",
                UserWarning,
                stacklevel=4,
            )


@precheck(getattr(aten.random_, "from"), getattr(aten.random, "from"))
def _random_from(args, kwargs):
    self, lo, to = args[0], arg(args, kwargs, 1, "from"), arg(args, kwargs, 2, "to")
    if to is None:  # up to random_()'s own bound: 2**digits, the type's max, 1 for bool
        check_from_to(self.dtype, lo, _dtype_max(to_jax_dtype(self.dtype)))
    elif lo < to:  # else the lowering raises ATen's "from < to" first
        check_from_to(self.dtype, lo, to - 1)


@precheck(aten.random_.to, aten.random.to)
def _random_to(args, kwargs):
    self, to = args[0], arg(args, kwargs, 1, "to")
    if 0 < to:
        check_from_to(self.dtype, 0, to - 1)
