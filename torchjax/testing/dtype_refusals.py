"""Survey which ATen ops CPU torch refuses for an input dtype; write the refusal table.

    python -m torchjax.testing.dtype_refusals [--jobs 2] [--ops SUBSTR ...] [--check]

Runs op_db's samples (the first ``LIMIT`` with a non-empty tensor per entry and dtype,
seeded as the test suite seeds them) on CPU in each of ``DTYPES`` under a dispatch mode
that sees each ATen overload as a tpu tensor's ``__torch_dispatch__`` sees it, and writes
torchjax/ops/dtype_refusals.json, the table torchjax/ops/dtype_refusals.py reads (Note
[Dtype inputs torch refuses]); a few minutes on 2 cores. ``--check`` writes nothing and
fails when the committed file differs from a fresh survey (after a torch upgrade).
``--ops`` surveys the op_db entries whose name contains one of the strings and prints the
result without writing it.

Note [Surveying dtype refusals]
A refusal is recorded for the overload the mode saw raise the exception that escaped the
sample (the innermost the mode sees: calls inside a kernel are not dispatched to it, and
on tpu the overload's handler runs in their place), when the message is a kernel's
refusal of a dtype: ``"<kernel>" not implemented for '<Type>'`` (ATen's dispatch macros)
naming the dtype of a tensor argument, or, for complex arguments, the checks that say so
in words ("ceil is not supported for complex inputs", "max(): does not support complex
input"). Other errors, even naming a dtype ("mean(): could not infer output dtype",
"expected scalar type Float but found Long", type promotion), are argument checks, not
refusals of a kernel, and stay out. An entry records:
- the arguments that held the refused dtype; the refusal applies when all of them hold
  it (``nll_loss`` refuses a Long ``self`` with its Long ``target``, not a Float ``self``
  with one);
- ``when``: the non-tensor arguments whose other value (default, None, the other bool)
  makes CPU accept the refused call, probed on each refusal: ``div`` with
  ``rounding_mode="trunc"`` refuses bool tensors, with None divides them;
- ``common``: CPU refuses the dtype the arguments promote to, as a TensorIterator
  kernel dispatches on its common dtype (``hypot`` of int8 and int16 refuses 'Short'):
  probed on each refusal of two or more tensors by making each of them bool in turn
  (which promotes to the refused dtype with the others), CPU refusing each alike;
- ``passes``: the shapes (empty, 0-dim) in which CPU accepted the overload with the same
  argument dtypes, answered before the kernel's dtype dispatch (``kthvalue`` of a 0-dim
  complex tensor returns it);
- the exception type and message (``{type}`` for the dtype's ATen name), with ``others``
  where CPU names another kernel on another path (softmax over the last dim or not);
- one sample per dtype that showed it, which tests/ops/test_dtype_refusals.py replays.
A sample generator may make nothing, or only empty tensors, in a dtype CPU refuses
(bucketize sorts its boundaries, and CPU sorts no complex tensor): in a dtype its entry
does not claim, ``CAST_FROM``'s samples also run, cast to the dtype. A candidate is left
out, with the reason in the file's ``excluded`` part, when
- CUDA accepts it: the OpInfo lists the dtype among its CUDA dtypes for its own call
  (not one with a Python number, Note [Python numbers in binary ops]; abs and trace of
  bool, histc of integers, half-precision avg_pool3d, upsampling and margin losses,
  nansum of complex), or the message says the refusal is CPU's ("Sort does not support
  complex dtypes on CPU", topk likewise). tpu answers as CUDA does;
- CPU accepted a non-empty, non-0-dim call of the overload with the same argument
  dtypes (and ``when`` values) in another sample: the refusal depends on more than the
  table can say (integer convolution: CPU's direct path takes it, its dilated one not);
- no tensor argument held the named dtype (factories' ``dtype=``: arange, linspace).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import pathlib
import re
import sys

import torch

from torchjax._compat.torch import TorchDispatchMode
from torchjax.ops.dtype_refusals import kind_of
from torchjax.testing._binary_forms import FORMS, forms_of, two_tensors

DATA_FILE = pathlib.Path(__file__).resolve().parents[1] / "ops" / "dtype_refusals.json"
DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)
LIMIT = 24  # samples per op_db entry and dtype
# Samples in a dtype an entry does not claim also come from this dtype's samples, their
# tensors of this dtype cast (``_samples``).
CAST_FROM = torch.float32
_MADE = 3 * LIMIT  # samples made, to find LIMIT with a non-empty tensor

_KERNEL = re.compile(r"not implemented for '(\w+)'")
_COMPLEX = re.compile(
    r"(not (yet )?(supported|implemented|intended to support)|does not support) (for )?complex"
)
_CPU_ONLY = re.compile(r"\bon CPU\b")
# Shapes some kernels answer without reaching their dtype dispatch (``kthvalue`` of a
# 0-dim tensor, most ops of an empty one): CPU accepting a call in such a shape does not
# make the refusal depend on more than dtypes; the entry lets those shapes pass.
EMPTY, ZERO_DIM, FULL = "empty", "0-dim", "full"


def sample(ref):
    """The op_db sample ``ref`` names: [entry, dtype, index], then, for a sample cast from
    ``CAST_FROM``, the source dtype, and for a sample in another form (``FORMS``), the
    form's name; called with ``op(ref)``."""
    from torchjax.testing import opinfo as oi

    name, dtype, index, *rest = ref
    source = [r for r in rest if r not in FORMS]
    (entry,) = oi.opinfos([name])
    made = oi.samples(entry, getattr(torch, (source or [dtype])[0]), limit=index + 1)[index]
    made = _cast(made, getattr(torch, dtype)) if source else made
    form = _form(ref)
    return made if form is None else FORMS[form][1](made)


def op(ref):
    """The function the sample ``ref`` names is called with: its op_db entry's, or its
    form's (a Python operator)."""
    from torchjax.testing import opinfo as oi

    (entry,) = oi.opinfos([ref[0]])
    form = _form(ref)
    return entry.get_op() if form is None else FORMS[form][0](entry)


def _form(ref):
    return next((r for r in ref[3:] if r in FORMS), None)


def _cast(made, dtype):
    from torchjax.testing import opinfo as oi

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == CAST_FROM else t

    return oi.map_tensors(cast, made)


def _samples(entry, dtype):
    """(ref, sample) of the samples of ``entry`` in ``dtype`` up to the ``LIMIT``-th with a
    non-empty tensor (searchsorted's first 24 are empty), those made before the sample
    generator fails; and where the entry does not claim ``dtype`` on CPU, as many of
    ``CAST_FROM``'s, cast to ``dtype``: a generator may make nothing in a dtype CPU
    refuses (bucketize sorts its boundaries, and CPU sorts no complex tensor); and each
    two-tensor sample of a binary entry in its other forms (Note [Python numbers in
    binary ops])."""
    from torchjax.testing import opinfo as oi

    name = oi.full_name(entry)
    found = [([name, _short(dtype), i], s) for i, s in enumerate(_made(entry, dtype))]
    if dtype != CAST_FROM and dtype not in entry.supported_dtypes("cpu"):
        source = _short(CAST_FROM)
        cast = enumerate(_made(entry, CAST_FROM))
        found += [([name, _short(dtype), i, source], _cast(s, dtype)) for i, s in cast]
    forms = forms_of(entry)
    return found + [
        ([*ref, form], FORMS[form][1](s)) for ref, s in found if two_tensors(s) for form in forms
    ]


def _made(entry, dtype):
    from torchjax.testing import opinfo as oi

    try:
        made = oi.samples(entry, dtype, limit=_MADE)
    except Exception:  # noqa: BLE001 - the generator fails in this dtype: keep what it made
        made = []
        while len(made) < _MADE:
            try:
                made = oi.samples(entry, dtype, limit=len(made) + 1)
            except Exception:  # noqa: BLE001 - as above
                break
    counted = 0
    for i, s in enumerate(made):
        leaves = oi.pytree.tree_flatten((s.input, s.args, s.kwargs))[0]
        counted += any(isinstance(t, torch.Tensor) and t.numel() for t in leaves)
        if counted == LIMIT:
            return made[: i + 1]
    return made


def _short(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _named(func, args, kwargs):
    """(schema argument name, value) of every argument of a call."""
    names = [a.name for a in func._schema.arguments]
    named = [(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


NUMBER_DTYPES = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
    complex: torch.complex128,
}


def holds(value, dtype) -> bool:
    """Whether an operand holds ``dtype``: a tensor (or list of tensors) of it, or a Python
    number that promotes into it (Note [Python numbers in binary ops])."""
    if isinstance(value, type):  # the survey's record of a number
        return kind_of(NUMBER_DTYPES[value]) <= kind_of(dtype)
    return value == dtype


_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


def _operand(arg) -> bool:
    """Whether a Python number in schema argument ``arg`` is an operand of the kernel: in
    a Tensor argument, or in a Scalar one without a default (``remainder.Scalar``'s
    ``other``, not ``softplus``'s ``beta`` or ``add``'s ``alpha``, which the kernel reads
    in the tensor's dtype)."""
    if str(arg.type) in _TENSOR_TYPES:
        return True
    return str(arg.type) == "number" and not arg.has_default_value()


def _operands(func, args, kwargs):
    """(schema argument name, dtype, shape class) of every tensor argument (list elements
    included), and (name, Python type, 0-dim) of every Python number that is an operand
    (``_operand``)."""
    operands = {a.name for a in func._schema.arguments if _operand(a)}
    found = []
    for name, a in _named(func, args, kwargs):
        if type(a) in NUMBER_DTYPES and name in operands:
            found.append((name, type(a), ZERO_DIM))
            continue
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                found.append((name, t.dtype, _shape(t)))
    return found


def _shape(t) -> str:
    return EMPTY if t.numel() == 0 else ZERO_DIM if t.dim() == 0 else FULL


def _as_bool(func, args, kwargs, name):
    """The call with argument ``name``'s tensors (or number) made bool."""

    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(torch.bool)
        if isinstance(v, (list, tuple)):
            return type(v)(cast(t) for t in v)
        return bool(v) if type(v) in NUMBER_DTYPES else v

    names = [a.name for a in func._schema.arguments]
    a, k = list(args), dict(kwargs)
    i = names.index(name) if name in names else len(a)
    if i < len(a):
        a[i] = cast(a[i])
    else:
        k[name] = cast(k[name])
    return a, k


def _common(func, args, kwargs, dtype, names, error):
    """Whether CPU refuses ``dtype`` as the common dtype of the arguments ``names``
    (Note [Surveying dtype refusals]): the call still refused alike with any one of
    them made bool, which promotes to ``dtype`` with the others; None where that cannot
    tell (one argument, a Python number among them, or bool refused)."""
    numbers = [n for n, a in _named(func, args, kwargs) if n in names and type(a) in NUMBER_DTYPES]
    if len(names) < 2 or dtype == torch.bool or numbers:
        return None
    for name in names:
        a, k = _as_bool(func, args, kwargs, name)
        try:
            func(*a, **k)
        except Exception as e:  # noqa: BLE001 - the same refusal, or anything else
            if type(e) is type(error) and str(e) == str(error):
                continue
        return False
    return True


def shape_class(shapes) -> str:
    """The shape class of a call from its refused arguments' shape classes."""
    shapes = list(shapes)
    return EMPTY if EMPTY in shapes else ZERO_DIM if set(shapes) == {ZERO_DIM} else FULL


def _plain(value) -> bool:
    """A non-tensor argument value a table entry can name (JSON, compared by ``==``)."""
    return value is None or isinstance(value, (bool, int, float, str))


def _alternatives(arg, value):
    """Other values of a non-tensor schema argument that may take another kernel path:
    its default, None where it is optional, the other bool."""
    if arg.has_default_value() and arg.default_value != value:
        yield arg.default_value
    if isinstance(arg.type, torch.OptionalType) and value is not None:
        yield None
    if isinstance(value, bool):
        yield not value


def _deciding_args(func, args, kwargs) -> dict:
    """{name: value} of the non-tensor arguments of a refused call whose change makes CPU
    accept it (``div``'s ``rounding_mode="trunc"``: None divides bool tensors)."""
    deciding = {}
    schema = {a.name: (i, a) for i, a in enumerate(func._schema.arguments)}
    for name, value in _named(func, args, kwargs):
        if name not in schema or not _plain(value):
            continue
        i, arg = schema[name]
        for other in _alternatives(arg, value):
            a, k = list(args), dict(kwargs)
            if i < len(a):
                a[i] = other
            else:
                k[name] = other
            try:
                func(*a, **k)
            except Exception:  # noqa: BLE001 - refused again, or another error: no change
                continue
            deciding[name] = value
            break
    return deciding


class _Recorder(TorchDispatchMode):
    """Every overload a sample dispatches: the accepted calls' argument dtypes, shapes and
    plain values, and the refusals. Inside ``__torch_dispatch__`` the mode is off, so
    calls an overload's kernel makes are not seen: as on tpu, where the overload's
    handler runs (and decomposes, or lowers, the overload as a whole)."""

    def __init__(self):
        super().__init__()
        self.accepted = set()
        self.refused = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = _operands(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            found = _refusal(operands, e)
            if found is not None:
                dtype, names = found[:2]
                common = _common(func, args, kwargs, dtype, names, e) if dtype else None
                deciding = _deciding_args(func, args, kwargs)
                self.refused.append((func, e, *found, deciding, common))
            raise
        sig = {(n, d, shape) for n, d, shape in operands}
        sig |= {(n, "=", v) for n, v in _named(func, args, kwargs) if _plain(v)}
        self.accepted.add((_key(func), frozenset(sig)))
        return out


def _key(func) -> str:
    return f"{func._opname}.{func._overloadname}"


def _type_name(dtype) -> str:
    from torchjax.tensor.dtypes import aten_type_name

    return aten_type_name(dtype)


def _refusal(operands, error):
    """(refused dtype, argument names holding it, their shape class, message template)
    when ``error`` is a dtype refusal (Note [Surveying dtype refusals]), else None; dtype
    None when no tensor argument holds the dtype the message names."""
    message = str(error)
    named = _KERNEL.search(message)
    if named is not None:
        matches = lambda d: _type_name(d) == named.group(1)  # noqa: E731
    elif _COMPLEX.search(message):
        matches = lambda d: d.is_complex  # noqa: E731
    else:
        return None
    dtypes = {d for _, d, _ in operands if not isinstance(d, type) and matches(d)}
    if len(dtypes) != 1:  # none held it, or complex64 and complex128 together
        return (None, (), FULL, message) if not dtypes else None
    (dtype,) = dtypes
    held = [(n, d, shape) for n, d, shape in operands if holds(d, dtype)]
    template = message.replace(f"'{_type_name(dtype)}'", "'{type}'")
    names = tuple(sorted({n for n, _, _ in held}))
    return dtype, names, shape_class(shape for _, _, shape in held), template


def survey_entry(name):
    """(accepted, refusals) of one op_db entry over ``DTYPES``: ``accepted`` holds
    (overload, signature) of every call CPU accepted, ``refusals`` one row per refused
    sample: (overload, dtype, args, when, error type, template, CUDA accepts, sample
    ref, common); dtype None where no tensor argument held the refused dtype."""
    from torchjax.testing import opinfo as oi

    (entry,) = oi.opinfos([name])
    cuda = entry.supported_dtypes("cuda")
    accepted, refusals = set(), []
    for sample_dtype in DTYPES:
        for ref, s in _samples(entry, sample_dtype):
            found, seen = run(op(ref), s)
            accepted |= seen
            if found is not None:
                key, dtype, args, _, when, error, template, common = found
                # OpInfo's CUDA dtypes are those of its own two-tensor call.
                listed = dtype in cuda and _form(ref) is None
                cuda_accepts = listed or bool(_CPU_ONLY.search(template))
                dtype = None if dtype is None else _short(dtype)
                row = (key, dtype, args, when, error, template, cuda_accepts, ref, common)
                refusals.append(row)
    return accepted, refusals


def run(fn, sample):
    """``fn`` on ``sample`` on CPU: (refusal, accepted calls). The refusal is None when
    ``fn`` returned or raised something else, else (overload, dtype, args, shape class,
    when, exception type name, message template, common) of the overload that refused."""
    rec = _Recorder()
    try:
        with rec:
            fn(sample.input, *sample.args, **sample.kwargs)
    except Exception as error:  # noqa: BLE001 - a refusal when the recorder saw one
        found = [r for r in rec.refused if r[1] is error]
        if found:
            func, _, dtype, args, shape, template, when, common = found[-1]
            name = type(error).__name__
            return (_key(func), dtype, args, shape, when, name, template, common), rec.accepted
    return None, rec.accepted


def _worker(name):
    return survey_entry(name)


def build_table(surveys):
    """The file's content from the surveys of op_db entries."""
    accepted = collections.defaultdict(set)
    found = collections.defaultdict(list)
    for acc, refusals in surveys:
        for key, sig in acc:
            accepted[key].add(sig)
        for key, dtype, *rest in refusals:
            found[key, dtype].append(rest)
    groups, excluded = collections.defaultdict(dict), collections.defaultdict(dict)
    commons = {}
    for (key, dtype), rows in sorted(found.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if dtype is None:
            excluded[key]["-"] = "no tensor argument holds the refused dtype"
            continue
        if any(r[4] for r in rows):
            excluded[key][dtype] = "CUDA accepts it (OpInfo's CUDA dtypes, or a CPU-only message)"
            continue
        args = sorted(set.intersection(*(set(r[0]) for r in rows)))
        commons[key, dtype] = {r[6] for r in rows}
        by_when = collections.defaultdict(list)
        for r in rows:
            by_when[json.dumps(r[1], sort_keys=True)].append(r)
        for when, same in by_when.items():
            shapes = _accepted_shapes(accepted[key], args, getattr(torch, dtype), same[0][1])
            if FULL in shapes:
                label = dtype if when == "{}" else f"{dtype} when {when}"
                excluded[key][label] = "CPU accepts a call with the same argument dtypes"
                continue
            messages = collections.Counter((r[2], r[3]) for r in same)
            (error, message), _ = messages.most_common(1)[0]
            others = sorted(m for _, m in messages if m != message)
            group = json.dumps([args, when, sorted(shapes), error, message, others])
            ref = min(r[5] for r in same if (r[2], r[3]) == (error, message))
            groups[key].setdefault(group, {})[dtype] = ref
    refused = {}
    for key, by_group in groups.items():
        refused[key] = []
        for group, samples in sorted(by_group.items()):
            args, when, passes, error, message, others = json.loads(group)
            entry = {"args": args, "error": error, "message": message, "samples": samples}
            entry.update({"when": json.loads(when)} if when != "{}" else {})
            entry.update({"passes": passes} if passes else {})
            entry.update({"others": others} if others else {})
            probed = set().union(*(commons[key, d] for d in samples)) - {None}
            entry.update({"common": True} if probed == {True} else {})
            refused[key].append(entry)
    return {
        "torch": torch.__version__.split("+")[0],
        "dtypes": [_short(d) for d in DTYPES],
        "refused": refused,
        "excluded": dict(excluded),
    }


def _accepted_shapes(accepted, args, dtype, when) -> set:
    """The shape classes of the calls CPU accepted with ``dtype`` in every one of ``args``
    and the ``when`` values."""
    shapes = set()
    for sig in accepted:
        if not all((n, "=", v) in sig for n, v in when.items()):
            continue
        held = [[s for n, d, s in _tensor_triples(sig) if n == a and holds(d, dtype)] for a in args]
        if all(held):
            shapes.add(shape_class(s for h in held for s in h))
    return shapes


def _tensor_triples(sig):
    return [t for t in sig if t[1] != "="]


def survey(names, jobs=1):
    if jobs > 1:
        # spawn, not fork: jax's runtime threads do not survive a fork.
        with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=50) as pool:
            return list(pool.imap_unordered(_worker, names))
    return [survey_entry(n) for n in names]


def dumps(table) -> str:
    """The table as JSON, one line per entry: a new survey's diff reads entry by entry."""

    def block(rows, indent):
        return "{\n" + ",\n".join(rows) + "\n" + indent + "}" if rows else "{}"

    line = lambda obj: json.dumps(obj, sort_keys=True)  # noqa: E731
    excluded = [f"  {line(k)}: {line(v)}" for k, v in sorted(table["excluded"].items())]
    refused = [
        f"  {line(k)}: [\n" + ",\n".join(f"   {line(e)}" for e in entries) + "\n  ]"
        for k, entries in sorted(table["refused"].items())
    ]
    rows = [
        f' "dtypes": {line(table["dtypes"])}',
        f' "excluded": {block(excluded, " ")}',
        f' "refused": {block(refused, " ")}',
        f' "torch": {line(table["torch"])}',
    ]
    return block(rows, "") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ops", nargs="*", default=())
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    from torchjax.testing import opinfo as oi

    names = [oi.full_name(o) for o in oi.reference_entries()]
    if args.ops:
        names = [n for n in names if any(s in n for s in args.ops)]
    text = dumps(build_table(survey(names, args.jobs)))
    if args.ops:
        print(text)
        return 0
    if args.check:
        same = DATA_FILE.read_text() == text
        print("up to date" if same else f"{DATA_FILE} differs from a fresh survey")
        return 0 if same else 1
    DATA_FILE.write_text(text)
    print(f"wrote {DATA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
