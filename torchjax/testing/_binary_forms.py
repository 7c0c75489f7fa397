"""The other forms of a binary op's two-tensor samples in the dtype-refusal survey: a
Python number on either side, and Python's operator (Note [Python numbers in binary
ops])."""

from __future__ import annotations

import operator

import torch


# Note [Python numbers in binary ops]
# op_db's binary samples hold tensors only, but a Python number reaches other overloads
# (``remainder.Scalar``, ``pow.Scalar``, ``clamp_min.default``, ``__lshift__.Scalar``)
# or the same one with a number in a Tensor argument (``t // True`` is
# ``floor_divide.default(t, True)``), and Python's operators (``t << u``) reach the
# dunder overloads. So each two-tensor sample of a binary entry (op_db's
# BinaryUfuncInfo) also runs with its second tensor, or its first, replaced by a Python
# number (its first element), and through the entry's Python operator where it has one.
# A number in an operand (``_operand``) holds a refused dtype when it promotes into it
# (its kind, bool < integer < float < complex, is no higher), as CPU's kernel reads it in
# the call's common dtype: ``t // True`` of a bool tensor is refused, ``t // 2`` is not.
def _number(t):
    return t.flatten()[0].item()


def two_tensors(s):
    return (
        isinstance(s.input, torch.Tensor)
        and s.input.numel() > 0
        and len(s.args) == 1
        and isinstance(s.args[0], torch.Tensor)
        and s.args[0].numel() > 0
        and not s.kwargs
    )


def _with(input, other):
    from torch.testing._internal.opinfo.core import SampleInput

    return SampleInput(input, args=(other,))


_OPERATORS = {
    "floor_divide": operator.floordiv,
    "remainder": operator.mod,
    "pow": operator.pow,
    "bitwise_left_shift": operator.lshift,
    "bitwise_right_shift": operator.rshift,
}

# form: (the function of the op_db entry it calls, the sample made from a two-tensor one)
FORMS = {
    "number_other": (lambda e: e.get_op(), lambda s: _with(s.input, _number(s.args[0]))),
    "number_self": (lambda e: e.get_op(), lambda s: _with(_number(s.input), s.args[0])),
    "operator": (lambda e: _OPERATORS[e.name], lambda s: s),
    "operator_number": (
        lambda e: _OPERATORS[e.name],
        lambda s: _with(s.input, _number(s.args[0])),
    ),
}


def forms_of(entry):
    if not hasattr(entry, "supports_rhs_python_scalar"):  # not a BinaryUfuncInfo
        return ()
    forms = ["number_other", "number_self"]
    if entry.name in _OPERATORS and not entry.variant_test_name:
        forms += ["operator", "operator_number"]
    return forms
