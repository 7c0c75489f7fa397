"""Ops whose CPU kernels take no tensors of some dtype, refused as torch refuses them.

Note [Dtype inputs torch refuses]
jax computes most ops in any dtype where torch has no kernel: ``softmax`` of int64
returned zeros, ``gelu`` and ``layer_norm`` of integers, ``max`` of complex (compared
lexicographically), ``atan2`` or ``xlogy`` of complex returned numbers, so a tpu tensor
answered where CPU raises; others failed inside jax with a RuntimeError where torch
raises NotImplementedError. dtype_refusals.json holds, per ATen overload, CPU torch's
refusals: the refused dtype, the arguments that must all hold it (``nll_loss`` refuses a
Long ``self`` with its Long ``target``, not a Float ``self``), the values of non-tensor
arguments the refusal depends on (``div``'s ``rounding_mode``), the shapes CPU answers
anyway (softmax of an empty tensor), and torch's exception type and message. The handler
of a listed overload (and of the in-place and ``out=`` overloads derived from it) checks
its arguments before any lowering or decomposition runs: a dict lookup by the first
argument's dtype per call. Every other overload's handler is its lowering, unwrapped: the
table costs nothing off it.

The file is generated, not written: ``python -m torchjax.testing.dtype_refusals`` runs
op_db's samples on CPU in every dtype and records the refusals (Note [Surveying dtype
refusals] says which errors count, and which refusals are left out because CUDA accepts
the dtype: complex ``sort`` and ``topk``, half-precision ``avg_pool3d``; tpu answers
those as CUDA does). Regenerate it after a torch upgrade (``--check`` says whether it
changed); tests/ops/test_dtype_refusals.py replays against CPU the sample each entry
records. Where CPU's message depends on more than the table says (softmax names its
last-dim kernel or its general one by ``dim``), tpu raises the message CPU gives most
often; the others are listed with it.

Some refusals the survey does not see: CPU makes them inside a composite kernel
(``native_dropout`` and ``soft_margin_loss`` write a float result in place into an
integer tensor) or in an argument check (``embedding_bag``'s weight types, ``polar``'s,
``random_``'s bounds, Note [random_ bounds] in torchjax/ops/random_bounds.py). Each is
checked in its op's module with CPU's text and compared with CPU in
tests/ops/test_dtype_refusals.py.
"""

from __future__ import annotations

import json
import pathlib

import torch

from torchjax.ops import schema
from torchjax.tensor.dtypes import aten_type_name

_FILE = pathlib.Path(__file__).with_name("dtype_refusals.json")
_ERRORS = {"NotImplementedError": NotImplementedError, "RuntimeError": RuntimeError}

# "op.overload" -> [{args, error, message, samples: {dtype: sample}, when?, passes?,
# others?}]; the dtypes an entry refuses are its samples' keys.
REFUSED: dict[str, list[dict]] = json.loads(_FILE.read_text())["refused"]


def _key(func) -> str:
    return f"{func._opname}.{func._overloadname}"


def _entries(func):
    found = REFUSED.get(_key(func))
    if found is None:
        sibling = schema.functional_sibling(func)
        found = None if sibling is None else REFUSED.get(_key(sibling))
    return found


def _checks(func, entries):
    """{place: {dtype: [(other places, [(place, value)], shapes that pass, exception type,
    message)]}}: the refusals of ``func``, found from the dtype of their first argument; a
    place is (position, name, default) in ``func``'s schema."""
    places = {
        a.name: (i, a.name, a.default_value if a.has_default_value() else None)
        for i, a in enumerate(func._schema.arguments)
    }
    checks = {}
    for entry in entries:
        if any(n not in places for n in (*entry["args"], *entry.get("when", ()))):
            continue
        first, *others = (places[n] for n in entry["args"])
        when = tuple((places[n], v) for n, v in entry.get("when", {}).items())
        for name in entry["samples"]:
            dtype = getattr(torch, name)
            message = entry["message"].replace("{type}", aten_type_name(dtype))
            passes = frozenset(entry.get("passes", ()))
            row = (tuple(others), when, passes, _ERRORS[entry["error"]], message)
            checks.setdefault(first, {}).setdefault(dtype, []).append(row)
    return checks


def _value(args, kwargs, place):
    i, name, default = place
    return args[i] if i < len(args) else kwargs.get(name, default)


def _dtypes(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype,)
    if isinstance(value, (list, tuple)):
        return {t.dtype for t in value if isinstance(t, torch.Tensor)}
    return ()


def _shape(values) -> str:
    """The shape class of the refused arguments (Note [Surveying dtype refusals])."""
    tensors = [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(t.numel() == 0 for t in tensors):
        return "empty"
    return "0-dim" if all(t.dim() == 0 for t in tensors) else "full"


def _refusal(checks, args, kwargs):
    for first, by_dtype in checks.items():
        value = _value(args, kwargs, first)
        # A tensor of a dtype no entry refuses, the common case: one lookup (about half
        # a microsecond a call, on the listed overloads only).
        dtype = getattr(value, "dtype", None)
        if dtype is not None and dtype not in by_dtype:
            continue
        for dtype in _dtypes(value):
            for others, when, passes, error, message in by_dtype.get(dtype, ()):
                if not all(dtype in _dtypes(_value(args, kwargs, p)) for p in others):
                    continue
                if not all(_value(args, kwargs, p) == v for p, v in when):
                    continue
                places = (first, *others)
                if passes and _shape([_value(args, kwargs, p) for p in places]) in passes:
                    continue
                return error(message)
    return None


def guarded(func, handler):
    """``handler`` of ``func``, refusing the dtypes CPU torch refuses first."""
    entries = None if func.namespace != "aten" else _entries(func)
    checks = _checks(func, entries) if entries else None
    if not checks:
        return handler

    def guarded_handler(args, kwargs):
        error = _refusal(checks, args, kwargs)
        if error is not None:
            raise error
        return handler(args, kwargs)

    return guarded_handler
