"""Ops whose torch kernels take no complex tensors, refused as torch refuses them.

Note [Complex inputs torch refuses]
jax computes many of these for complex input where torch has no kernel: ``max`` and
``amax`` compare complex numbers lexicographically, ``atan2``, ``xlogy``, ``logit`` and
``bucketize`` return numbers, so a tpu tensor answered where CPU and CUDA raise; others
(``round``, ``erf``) failed inside jax with a RuntimeError where torch raises
NotImplementedError. The table holds, per ATen op (functional, in-place and ``out=``
overloads alike, or one overload), torch 2.13's exception type and message for a complex
tensor argument; the handler of such an overload checks its tensor arguments before any
lowering or decomposition runs (a dtype test per call, on these ops only).
tests/ops/test_dtype_refusals.py compares every entry with CPU. Ops that refuse complex
on CPU only (``sort``, ``max.dim``: CUDA sorts complex) are not listed: tpu answers as
CUDA does.
"""

from __future__ import annotations

import torch

from torchjax.tensor.dtypes import aten_type_name

_NI = NotImplementedError


def _kernel(name):
    return (_NI, f'"{name}" not implemented for ' + "'{type}'")


# op name (or "name.overload") -> (exception type, message with {type} for the dtype)
REFUSED_COMPLEX = {
    "round": _kernel("round_vml_cpu"),
    "round.decimals": _kernel("round_cpu"),
    "ceil": (_NI, "ceil is not supported for complex inputs"),
    "floor": (_NI, "floor is not supported for complex inputs"),
    "trunc": (_NI, "trunc is not supported for complex inputs"),
    "frac": _kernel("frac_cpu"),
    "sign": (
        _NI,
        "Unlike NumPy, torch.sign is not intended to support complex numbers. Please use "
        "torch.sgn instead.",
    ),
    "signbit": (_NI, "signbit is not implemented for complex tensors."),
    "lgamma": _kernel("lgamma_vml_cpu"),
    "digamma": _kernel("digamma"),
    "erf": _kernel("erf_vml_cpu"),
    "erfc": _kernel("erfc_vml_cpu"),
    "erfinv": _kernel("erfinv_vml_cpu"),
    "i0": _kernel("i0_vml_cpu"),
    "logit": _kernel("logit_cpu"),
    "heaviside": (RuntimeError, "heaviside is not yet implemented for complex tensors."),
    "hypot": _kernel("hypot_cpu"),
    "atan2": _kernel("atan2_cpu"),
    "copysign": _kernel("copysign_cpu"),
    "nextafter": _kernel("nextafter_cpu"),
    "xlogy": _kernel("xlogy_cpu"),
    "igamma": _kernel("igamma_cpu"),
    "igammac": _kernel("igammac_cpu"),
    "rad2deg": (RuntimeError, "rad2deg is not supported for complex tensors."),
    "deg2rad": (RuntimeError, "deg2rad is not supported for complex tensors."),
    "max.default": _kernel("max_all"),
    "min.default": _kernel("min_all"),
    "amax": _kernel("max_values_cpu"),
    "amin": _kernel("min_values_cpu"),
    "aminmax": _kernel("aminmax_cpu"),
    "kthvalue": _kernel("kthvalue_cpu"),
    "median": _kernel("median_cpu"),
    "nanmedian": _kernel("median_cpu"),
    "mode": _kernel("mode_cpu"),
    "bucketize": _kernel("searchsorted_out_cpu"),
    "searchsorted": _kernel("searchsorted_out_cpu"),
}


def _refusal(func):
    name = func._opname.rstrip("_")
    found = REFUSED_COMPLEX.get(f"{name}.{func._overloadname}")
    return found if found is not None else REFUSED_COMPLEX.get(name)


def _complex_arg(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.is_complex():
                return a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and b.is_complex():
                    return b
    return None


def guarded(func, handler):
    """``handler`` of ``func``, refusing complex tensors first where torch does."""
    refusal = None if func.namespace != "aten" else _refusal(func)
    if refusal is None:
        return handler
    error, message = refusal

    def guarded_handler(args, kwargs):
        bad = _complex_arg(args, kwargs)
        if bad is not None:
            raise error(message.format(type=aten_type_name(bad.dtype)))
        return handler(args, kwargs)

    return guarded_handler
