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
anyway (softmax of an empty tensor), whether the refused dtype is the one the arguments
promote to (``common``: TensorIterator kernels dispatch on it, so ``hypot`` of int8 and
int16 refuses 'Short', and ``t // True`` of a bool tensor 'Bool'; otherwise every listed
argument must hold it, a Python number holding the dtypes it promotes into), and torch's
exception type and message. The handler of a listed overload (and of the in-place and
``out=`` overloads derived from it) checks its arguments before any lowering or
decomposition runs: a dict lookup by the first tensor argument's dtype per call (by the
promoted dtype where the arguments' dtypes differ and the entry is ``common``). Every
other overload's handler is its lowering, unwrapped: the table costs nothing off it.

The file is generated, not written: ``python -m torchjax.testing.dtype_refusals`` runs
op_db's samples on CPU in every dtype and records the refusals (Note [Surveying dtype
refusals] says which errors count, and which refusals are left out because CUDA accepts
the dtype: complex ``sort`` and ``topk``, half-precision ``avg_pool3d``; tpu answers
those as CUDA does). Regenerate it after a torch upgrade (``--check`` says whether it
changed); tests/ops/test_dtype_refusals.py replays against CPU the sample each entry
records. Where CPU's message depends on more than the table says (softmax names its
last-dim kernel or its general one by ``dim``), tpu raises the message CPU gives most
often; the others are listed with it.

Note [Checks before the refusal]
A few kernels check their arguments' shapes before they dispatch on the dtype: ``addmm``
is a structured kernel whose meta function checks that the dtypes agree and that the
matrices multiply, and whose CPU kernel then expands ``self`` to the result, all before
``AT_DISPATCH`` refuses 'Bool'. A bool call with bad shapes raises the shape error there,
and the refusal only for shapes that fit. The guard here runs before any lowering, so an
op's module registers those checks with ``checked_first``: they run when a refusal of one
of its overloads is about to be raised, and raise first if the call fails them. They run
on the refusal path only; a call no entry refuses never reaches them. Some kernels refuse
the dtype only where they reach their dispatch: ``mv`` of a bool matrix with no rows, or
``baddbmm`` with nothing to multiply, returns before it, which the table's survey samples
do not show; their checks are registered ``whole`` (they raise the refusal themselves,
where the kernel does), and a call they pass runs the handler instead of being refused.

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

from torchjax.ops import promotion, schema, writeback
from torchjax.tensor.dtypes import aten_type_name

_FILE = pathlib.Path(__file__).with_name("dtype_refusals.json")
_ERRORS = {"NotImplementedError": NotImplementedError, "RuntimeError": RuntimeError}

# "op.overload" -> [{args, error, message, samples: {dtype: sample}, when?, passes?,
# others?}]; the dtypes an entry refuses are its samples' keys.
REFUSED: dict[str, list[dict]] = json.loads(_FILE.read_text())["refused"]


# overload packet -> (fn(args, kwargs), whole), run before a refusal is raised (Note
# [Checks before the refusal]).
_CHECKED_FIRST: dict = {}


def checked_first(*packets, whole=False):
    """Register ``fn(args, kwargs)`` (the torch-level arguments of an overload of
    ``packets``, or of its in-place or ``out=`` form) to run before a refusal of that call
    is raised: the checks CPU's kernel makes before it dispatches on the dtype (Note
    [Checks before the refusal]). ``whole``: ``fn`` makes the kernel's dtype refusal too,
    where the kernel makes it, so a call it passes is one CPU answers."""

    def deco(fn):
        for packet in packets:
            _CHECKED_FIRST[packet] = (fn, whole)
        return fn

    return deco


def _run_checked_first(func, args, kwargs) -> bool:
    """Run the checks registered for ``func``; True when they are whole and passed."""
    entry = _CHECKED_FIRST.get(func.overloadpacket)
    if entry is None:
        sibling = schema.functional_sibling(func)
        entry = None if sibling is None else _CHECKED_FIRST.get(sibling.overloadpacket)
    if entry is None:
        return False
    check, whole = entry
    check(args, kwargs)
    return whole


def _key(func) -> str:
    return f"{func._opname}.{func._overloadname}"


def _entries(func):
    found = REFUSED.get(_key(func))
    if found is None:
        sibling = schema.functional_sibling(func)
        if sibling is None and func._opname.startswith("__i"):
            # Python's ``<<=``: __ilshift__.Scalar is __lshift__.Scalar in place
            packet = getattr(torch.ops.aten, f"__{func._opname[3:]}", None)
            sibling = getattr(packet, func._overloadname, None)
        found = None if sibling is None else REFUSED.get(_key(sibling))
    return found


def _checks(func, entries):
    """[((places, common), {dtype: [(when, shapes that pass, exception type, message)]})]:
    the refusals of ``func`` by the arguments they read; a place is (position, name,
    default) in ``func``'s schema, ``when`` lists (place, value)."""
    places = {
        a.name: (i, a.name, a.default_value if a.has_default_value() else None)
        for i, a in enumerate(func._schema.arguments)
    }
    checks = {}
    for entry in entries:
        if any(n not in places for n in (*entry["args"], *entry.get("when", ()))):
            continue
        held = tuple(places[n] for n in entry["args"])
        when = tuple((places[n], v) for n, v in entry.get("when", {}).items())
        by_dtype = checks.setdefault((held, bool(entry.get("common"))), {})
        for name in entry["samples"]:
            dtype = getattr(torch, name)
            message = entry["message"].replace("{type}", aten_type_name(dtype))
            passes = frozenset(entry.get("passes", ()))
            row = (when, passes, _ERRORS[entry["error"]], message)
            by_dtype.setdefault(dtype, []).append(row)
    return list(checks.items())


def _value(args, kwargs, place):
    i, name, default = place
    return args[i] if i < len(args) else kwargs.get(name, default)


_NUMBERS = (bool, int, float, complex)


def kind_of(dtype) -> int:
    """bool 0 < integer 1 < floating 2 < complex 3: the kinds of torch's promotion."""
    if dtype.is_complex:
        return 3
    return 2 if dtype.is_floating_point else 0 if dtype == torch.bool else 1


_NUMBER_KINDS = {bool: 0, int: 1, float: 2, complex: 3}


def _holds(value, dtype) -> bool:
    """Whether an argument holds ``dtype``: a tensor (or list of tensors) of it, or a Python
    number that promotes into it (no higher kind: ``t // True`` of a bool tensor runs in
    bool, ``t // 2`` in int64)."""
    if isinstance(value, torch.Tensor):
        return value.dtype == dtype
    if isinstance(value, (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.dtype == dtype for t in value)
    kind = _NUMBER_KINDS.get(type(value))
    return kind is not None and kind <= kind_of(dtype)


def _tensors(values):
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))]


def _looked_up(values, common):
    """The dtypes a refusal is looked up by: its tensors' (usually one), or for an entry
    refusing the common dtype of its arguments (a TensorIterator kernel's dispatch dtype:
    ``hypot`` of int8 and int16 refuses 'Short'), that one."""
    dtypes = {t.dtype: None for t in _tensors(values) if isinstance(t, torch.Tensor)}
    if not common or not dtypes:
        return dtypes
    if len(dtypes) == 1:
        (dtype,) = dtypes
        kind = kind_of(dtype)
        # One tensor dtype and numbers of no higher kind (``i // 3``): the common dtype is
        # the tensors' own, with no promotion to compute.
        if all(
            isinstance(v, torch.Tensor) or _NUMBER_KINDS.get(type(v), 9) <= kind for v in values
        ):
            return dtypes
    if any(not isinstance(v, (torch.Tensor, *_NUMBERS)) for v in values):
        return ()  # a list or None: no promotion to read
    return (promotion.common_dtype(values),)


def _shape(values) -> str:
    """The shape class of the refused arguments (Note [Surveying dtype refusals])."""
    tensors = [t for t in _tensors(values) if isinstance(t, torch.Tensor)]
    if any(t.numel() == 0 for t in tensors):
        return "empty"
    return "0-dim" if all(t.dim() == 0 for t in tensors) else "full"


def _written(func):
    """The place of the tensor an in-place or ``out=`` overload writes, or None."""
    names = [a.name for a in func._schema.arguments]
    outs = schema.out_names(func._schema)
    if not outs and not schema.is_inplace(func._schema):
        return None
    name = outs[0] if outs else names[0]
    return (names.index(name), name, None)


def _refusal(func, checks, args, kwargs, written=None):
    for (places, common), by_dtype in checks:
        values = [_value(args, kwargs, p) for p in places]
        # A tensor of a dtype no entry refuses, the common case: a lookup (about half a
        # microsecond a call, on the listed overloads only).
        for dtype in _looked_up(values, common):
            rows = by_dtype.get(dtype)
            if rows is None:
                continue
            if not common and not all(_holds(v, dtype) for v in values):
                continue
            if common and written is not None:
                # TensorIterator checks that the common dtype casts to the written tensor
                # before its kernel runs: ``bool_t.hypot_(uint8_t)`` raises "result type
                # Byte can't be cast to the desired output type Bool".
                out = _value(args, kwargs, written)
                if isinstance(out, torch.Tensor):
                    writeback.check_castable(func, dtype, out.dtype)
            for when, passes, error, message in rows:
                if not all(_value(args, kwargs, p) == v for p, v in when):
                    continue
                if passes and _shape(values) in passes:
                    continue
                return error(message)
    return None


def guarded(func, handler):
    """``handler`` of ``func``, refusing the dtypes CPU torch refuses first."""
    entries = None if func.namespace != "aten" else _entries(func)
    checks = _checks(func, entries) if entries else None
    if not checks:
        return handler

    written = _written(func)

    def guarded_handler(args, kwargs):
        error = _refusal(func, checks, args, kwargs, written)
        if error is not None:
            if _run_checked_first(func, args, kwargs):
                return handler(args, kwargs)
            raise error
        return handler(args, kwargs)

    return guarded_handler
