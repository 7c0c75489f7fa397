"""Python floats that are values of a trace: ``torch.SymFloat`` over a jax scalar.

Note [Traced Python floats]
A compiled graph often computes with a Python float that changes between calls: an
optimizer's learning rate and momentum under an LR schedule (OneCycleLR sets both every
step). Dynamo hands such a float to the backend as a 0-d CPU tensor input read by
``.item()`` (Note [Python floats Dynamo passes as tensors] in torchjax/compile/_dynamo.py).
Made a Python number, each new value is a new static value of the program: one XLA
compilation per training step. Instead the input stays an input of the program, and
``.item()`` gives a ``torch.SymFloat`` whose node, a ``TracedFloat``, holds the traced
value (a weakly typed float64 scalar, so it promotes as a Python float does):

- Python arithmetic in the graph (``1 - lr * wd``, ``lr / bias_correction``) runs as jax
  arithmetic on the values, in float64 as Python computes;
- torch ops take the SymFloat wherever they take a number (torch's argument parser
  accepts any SymFloat as a Scalar), and the registry unwraps it to its jax value
  (``ops/functional.py``): promotion treats it as a Python float (``promotion.py``),
  and a lowering computes with it as with a number (``x * value``);
- anything that needs the number itself (``float(lr)``, ``if lr > 0``, a lowering that
  branches on it, an op with a ``float`` argument rather than a Scalar) raises
  ``NeedsValue``, and the graph is traced again with the numbers as static values, the
  way it was before (compile/_dynamo.py), so nothing runs with a wrong number.

Each operation keeps Python's semantics: float64 arithmetic, ``int`` operands widened to
float, comparisons giving a ``SymBool`` that refuses ``bool()`` the same way.

Where a traced value would not be the number eager uses, the graph takes static numbers
from the start or on its first trace:

- a graph split around host copies (a host part would compute with a dead tracer: NaN),
  and a graph built with grad mode on whose inputs require grad (autograd keeps the
  float for a backward traced later) are static from the start (compile/_dynamo.py);
- ``x ** s``: ATen picks sqrt, rsqrt, ``x * x``... by the exponent's value, which differ
  from the general power at -inf and -0.0 (ops/power.py);
- a number an op checks against its result dtype (clamp's bounds, add's alpha): for a
  float result the check is made on the device and raised when the program returns,
  with eager's text (``_checks.require``, at-op); for an integer result the conversion's
  rules need the number (ops/functional.py);
- any SymNode method this node lacks (``is_integer``, ``sym_and``, ``round(s, n)``).

Known differences left: a float32-subnormal value (below 1.2e-38) made from the float
inside the program is flushed to zero by XLA, and ``1.0 / s`` at ``s == 0.0`` gives inf
where Python raises ZeroDivisionError (the division is the program's, not Python's).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchjax._compat.jax import weak_float


class NeedsValue(RuntimeError):
    """A traced Python float was asked for its number (``float()``, ``bool()`` of a
    comparison, an op argument typed ``float``): the graph is traced with static values
    instead (Note [Traced Python floats])."""


class _Missing(NeedsValue, AttributeError):
    """A SymNode method ``TracedFloat`` lacks: ``hasattr`` answers False, a call falls
    back to static values."""


def _value(node_or_number):
    return node_or_number.value if isinstance(node_or_number, TracedFloat) else node_or_number


def _needs_value(what):
    raise NeedsValue(f"a traced Python float was read as a number ({what})")


class TracedFloat:
    """A ``torch.SymFloat`` (or ``SymBool``) node over a traced jax scalar (the
    duck-typed interface of ``torch.fx.experimental.sym_node.SymNode``)."""

    __slots__ = ("value", "kind")

    def __init__(self, value, kind: str = "float"):
        self.value = value
        self.kind = kind

    def __getattr__(self, name):
        # Any other SymNode method (sym_and, is_integer, ...): the number is needed.
        raise _Missing(f"a traced Python float was asked for {name!r}")

    # -- what torch asks of a node -------------------------------------------------------
    def is_int(self) -> bool:
        return self.kind == "int"

    def is_float(self) -> bool:
        return self.kind == "float"

    def is_bool(self) -> bool:
        return self.kind == "bool"

    def is_nested_int(self) -> bool:
        return False

    def is_symbolic(self) -> bool:
        return True

    def is_constant(self) -> bool:
        return False

    def has_hint(self) -> bool:
        return False

    def maybe_as_int(self):
        return None

    def maybe_as_float(self):
        return None

    def maybe_as_bool(self):
        return None

    def constant_int(self):
        return None

    def nested_int(self):
        return None

    def wrap_float(self, num):
        return TracedFloat(num, "float")

    def wrap_int(self, num):
        return TracedFloat(num, "int")

    def wrap_bool(self, num):
        return TracedFloat(num, "bool")

    def clone(self):
        return self

    def str(self) -> str:
        return f"TracedFloat({self.kind})"

    _graph_repr = __repr__ = __str__ = str

    # -- reads of the number: refused ----------------------------------------------------
    def guard_float(self, file, line):
        _needs_value("float()")

    def guard_int(self, file, line):
        _needs_value("int()")

    def guard_bool(self, file, line):
        _needs_value("bool()")

    def bool_(self):
        _needs_value("bool()")

    def int_(self):
        _needs_value("int()")

    def expect_true(self, file, line):
        _needs_value("a check")

    def guard_or_false(self, file, line):
        _needs_value("a check")

    def guard_or_true(self, file, line):
        _needs_value("a check")

    def statically_known_true(self, file, line):
        return False

    def guard_size_oblivious(self, file, line):
        _needs_value("a check")

    # -- arithmetic, as Python computes it -----------------------------------------------
    def _float(self, value):
        return TracedFloat(weak_float(value), "float")

    def _binary(self, fn, other):
        return self._float(fn(jnp.asarray(self.value), _value(other)))

    def add(self, other):
        return self._binary(jnp.add, other)

    def sub(self, other):
        return self._binary(jnp.subtract, other)

    def mul(self, other):
        return self._binary(jnp.multiply, other)

    def truediv(self, other):
        return self._binary(jnp.true_divide, other)

    float_truediv = int_truediv = truediv

    def mod(self, other):
        return self._binary(jnp.mod, other)

    def floordiv(self, other):
        return self._binary(jnp.floor_divide, other)

    int_floordiv = floordiv

    def pow(self, other):
        return self._binary(jnp.power, other)

    float_pow = pow_by_natural = pow

    def sym_min(self, other):
        return self._binary(jnp.minimum, other)

    def sym_max(self, other):
        return self._binary(jnp.maximum, other)

    def neg(self):
        return self._float(-jnp.asarray(self.value))

    def pos(self):
        return self

    def abs(self):
        return self._float(jnp.abs(self.value))

    def sym_float(self):
        return self if self.kind == "float" else self._float(jnp.asarray(self.value))

    def _compare(self, fn, other):
        return TracedFloat(fn(jnp.asarray(self.value), _value(other)), "bool")

    def eq(self, other):
        return self._compare(jnp.equal, other)

    def ne(self, other):
        return self._compare(jnp.not_equal, other)

    def lt(self, other):
        return self._compare(jnp.less, other)

    def le(self, other):
        return self._compare(jnp.less_equal, other)

    def gt(self, other):
        return self._compare(jnp.greater, other)

    def ge(self, other):
        return self._compare(jnp.greater_equal, other)

    def sym_not(self):
        return TracedFloat(jnp.logical_not(self.value), "bool")

    # Rounding to an int would make a SymInt: a shape or an index; refused.
    def sym_int(self, *args):
        _needs_value("int()")

    floor = ceil = trunc = round = sym_int

    def sym_sqrt(self):
        return self._float(jnp.sqrt(self.value))

    def sym_cos(self):
        return self._float(jnp.cos(self.value))

    def sym_sin(self):
        return self._float(jnp.sin(self.value))

    def sym_tan(self):
        return self._float(jnp.tan(self.value))

    def sym_cosh(self):
        return self._float(jnp.cosh(self.value))

    def sym_sinh(self):
        return self._float(jnp.sinh(self.value))

    def sym_tanh(self):
        return self._float(jnp.tanh(self.value))

    def sym_asin(self):
        return self._float(jnp.arcsin(self.value))

    def sym_acos(self):
        return self._float(jnp.arccos(self.value))

    def sym_atan(self):
        return self._float(jnp.arctan(self.value))

    def sym_log2(self):
        return self._float(jnp.log2(self.value))


def traced(value) -> torch.SymFloat:
    """A ``torch.SymFloat`` over the traced float ``value`` (a 0-d jax array)."""
    return torch.SymFloat(TracedFloat(weak_float(value)))


def is_traced(x) -> bool:
    """Whether ``x`` is a SymFloat (or SymBool) over a traced value."""
    return isinstance(x, (torch.SymFloat, torch.SymBool)) and isinstance(x.node, TracedFloat)


def value_of(x):
    """The jax scalar of a traced SymFloat; ``NeedsValue`` for any other symbolic number
    (no torchjax lowering computes with a symbolic float of another kind)."""
    node = x.node
    if isinstance(node, TracedFloat) and node.kind == "float":
        return node.value
    _needs_value(f"a symbolic {type(x).__name__} as an op argument")
