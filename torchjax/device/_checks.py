"""Device-side value checks, reported at the next synchronisation point.

Note [Device-side checks]
An index out of range or an integer division by zero must raise (torch does; XLA
would clamp an index or return garbage), but reading the data back to the host on
every ``embedding``/``index_select``/``//`` call would synchronise each op and stall
the device. So, as CUDA reports device-side asserts asynchronously, a lowering states
its check as device arrays: ``require(bad, value, exc, message)`` with ``bad`` a
boolean scalar (True: the input is invalid), ``value`` the offending value to name (or
a pair of them) and ``message`` a template with ``{value}`` (and ``{value2}``), or a
function of the values. Nothing is read then:

- inside an eager op's cached executable (Note [Compiled lowerings]) the check becomes
  more outputs of that executable; op by op it is computed like the op itself;
- the check joins the pending list of this process; the next synchronisation point
  (``.item()``, ``.cpu()``, ``print``/``repr``, ``.tolist()``, ``torch.tpu.synchronize()``,
  the end of ``backward()``) reads every pending flag in one transfer and raises the
  first failure, in program order, with its op and value: ``IndexError: index 7 is out
  of bounds for dimension 0 with size 5 (in aten::index_select)``. Results of the
  failed op are undefined, as after a CUDA device assert; the error says the op, so no
  result is silently clamped into use;
- immediate mode (``TORCHJAX_SYNC_CHECKS=1`` in the environment, or
  ``torch.tpu.set_sync_checks(True)``) reads the flag at the op and raises there: slower
  (one host read per checked op), for debugging;
- under ``torchjax.jit`` and ``torch.compile(backend="tpu")`` the checks become outputs
  of the compiled program (Note [Device checks of compiled programs]).

Deferred only where CUDA defers. A check is deferred where CUDA's kernel makes it a
device assert, so that a program written for CUDA sees the failure where it would
there; where every torch backend raises at the op (a host read inside the op, or a
check CPU makes and CUDA does not make at all) the check is made at the op:
``require(..., deferred=False)`` queues it and synchronises at once (earlier pending
checks first, as a CUDA host read would report an earlier device assert), with CPU
torch's exception and text, word for word: the error layer adds no op name to it
(``_errors.verbatim``), so an op and a compiled call raise the same text. The audit of
every check written with ``require``:

- deferred (CUDA device asserts): indices of ``index``/``index_put``, ``gather``/
  ``scatter``, ``index_select``/``index_add``/``index_copy``/``index_fill``, ``take``/
  ``put``/``take_along_dim``, ``scatter_reduce``/``index_reduce``, ``embedding``,
  ``embedding_bag``, ``max_unpool2d``/``max_unpool3d`` (CUDA_KERNEL_ASSERT in each
  kernel; CPU's text, ``Found an invalid max index``); ``nll_loss``'s targets;
  ``multi_margin_loss``'s targets (LossMultiMargin.cu); ``binary_cross_entropy``'s input
  and target outside [0, 1] or NaN (Loss.cu asserts both; CPU's text names the first
  bad element's); ``one_hot``'s classes (ATen skips its host check for CUDA and
  PrivateUse1 and relies on scatter's assert); ``torch._assert_async``; ``bernoulli``'s
  probability tensor and ``poisson``'s rates (asserts in the CUDA samplers);
  ``multinomial`` with replacement and more than one sample (asserts in CUDA's sampling
  kernel);
- at the op (no CUDA device assert; CPU raises at the op): integer ``div``/
  ``floor_divide``/``remainder``/``fmod`` by zero (CPU raises ``ZeroDivisionError``, CUDA
  checks nothing; ``zero_divisor`` in torchjax/ops/pointwise_binary.py reads a divisor
  that is a Python number or a CPU tensor on the host, a tpu tensor's on the device),
  ``histc`` with a range taken from the data (CPU and CUDA read min and max back:
  ``torch.histc: range of [1, inf] is not finite``), ``multinomial`` without
  replacement or with one sample (ATen's device-generic path reads its ``probability
  tensor contains ...``/``sum of probabilities <= 0`` checks back). The ``with
  replacement=False, not enough non-negative category`` check is gone: that path of
  torch does not make it (it samples zero-weight categories last);
  ``ctc_loss``'s lengths (LossCTC.cpp and LossCTC.cu check them on the host: lengths
  given as lists, CPU tensors or concrete arrays are read there, tpu tensors on the
  device, at the op); ``searchsorted``'s ``sorter`` (``searchsorted_pre_check`` reads
  its min and max back on CPU and CUDA); ``multilabel_margin_loss``'s targets (CPU reads
  their min and max back, CUDA checks nothing); ``embedding_bag``'s ``offsets[0] == 0``
  and ``offsets[-1] <= len(indices)`` (CPU's ``check_arguments``; CUDA's kernels start
  the first bag at 0 and check neither). The last two cost a host read per call, and
  per call of a compiled program holding them, where CUDA reads nothing;
- at the op, the nested-tensor path of ``nn.TransformerEncoder`` (CPU and CUDA hold a
  nested tensor's sizes on the host): ``_nested_tensor_from_mask``'s ``mask_check`` and,
  on its padded stand-in, ``to_padded_tensor``'s "at least one constituent tensor"
  and truncation checks (torchjax/ops/transformer_nested.py); a host read per call;
- at the op, linear algebra (CPU and CUDA read LAPACK's ``info`` back and raise there):
  ``_linalg_check_errors`` behind ``linalg.inv``/``inverse``/``matrix_power`` (negative
  powers)/``tensorinv``, ``linalg.solve``/``tensorsolve``, ``linalg.cholesky``/
  ``cholesky``, ``linalg.lu_factor``, ``linalg.ldl_factor``; the ``_ex`` ops with
  ``check_errors=True``; ``cholesky_inverse`` of a factor with a zero on its diagonal;
  ``_linalg_svd`` (``linalg.svd``, ``svdvals``, ``pinv``, ``matrix_rank``...) of a matrix
  holding NaN. Texts are torch's, batch element included (torchjax/ops/linalg.py);
- torchjax's own (no torch counterpart), deferred: the Pallas kernel ops' checks on
  their arguments (``lengths`` and ``page_table`` entries of decode attention, integers
  narrowed to 32 bits), bounds of positions a kernel indexes with, the kind of check a
  CUDA kernel makes with a device assert; and the checks a user's ``jax_function``
  writes with ``require`` (deferred unless it passes ``deferred=False``).

The end of ``backward()``: the first tpu op of a backward pass that finds checks pending
(the forward's, or its own) queues an autograd-engine callback that reads them when the
pass ends, so ``loss.backward()`` raises the failure, as the op's own error would
(Note [Errors inside the autograd engine] in torchjax/tensor/_backward_errors.py). That
read waits for the checks' inputs (the indices, the divisors), not for the backward's
results; a pass with no checks pending reads nothing. It is one host read per backward
of a model with checked ops (an embedding): the price of reporting there.

The pending list is folded on the device every ``_FOLD_AT`` entries (one small
executable), so a loop that never synchronises keeps a few arrays, not thousands.

Note [Device checks of compiled programs]
``torchjax.jit`` (and the ``torch.compile`` backend, which runs each graph through it)
traces the function once; its ops see tracers, so no check can be read there. While the
program is traced, every check its ops make (``require``, and the check outputs of the
eager executables inlined into it) is collected (``carried``) instead, folded inside
the program into one (failed, values, code) - the first failure in program order - and
returned as four more outputs. After each call those join the pending list, exactly as
an eager op's checks do: raised at the next synchronisation point, with the failing
op's own message (``IndexError: ... (in aten::index.Tensor)``); in immediate mode, by
the call. A program holding a check made at the op in eager (an integer division by a
tensor, ``histc`` over the data's range) reads its flags when the call returns and
raises there, as eager raises at that op: one host read per call of such a program,
which then waits for the program to finish. So a compiled function raises what the
same code raises eagerly, when eager would have raised it (at the latest at the same
synchronisation point), and a program without checks costs nothing more. The state a
call writes (parameters, buffers, donated or not) is written back before anything is
raised, so the tensors stay usable after the error. Cost (``python bench/checks.py``, a
2-core CPU): a tiny Llama forward and train step ran at the same speed as with the
checks dropped, within noise; a near-empty program paid about 5 us a call (four more
outputs, one queue entry); a first call compiled 30 to 200 ms longer (the checks'
reductions are no longer dead code).

One check per distinct input. A lowering may say what its check is a function of:
``require(..., depends=(static, arrays))`` states that the flag and the values are
determined by the check's code, the hashable ``static`` and ``arrays`` (a range check:
its bounds and the index array). Within one traced program a check equal to one already
carried (same code and static part; each array the same value of the outer trace, by
identity, or a small constant of equal contents) is dropped: if it failed, the earlier
one failed first, with the same values and text, so the first failure in program order
is unchanged. An eager op's executable carries these keys with its check outputs, its
arrays as positions of its inputs, so that its calls inside a trace are told apart by
the arguments each gets. A static cache's writes are why: each layer's key and value
writes check the same position against the same size (the prefill of an empty cache:
every layer's positions, constants made afresh per layer), one check per write where
one per position suffices. Under grad mode an op reads an argument that does not
require grad through a fresh ``stop_gradient`` (Note [Stopped gradients in compiled
programs]): there each op's index is another array, and nothing is dropped. Eager
calls queue every check as before (each is a program of its own).

Not carried: checks made inside a nested transformation of the trace (a ``lax.scan``
or ``jax.vjp`` a lowering runs itself: their tracers belong to another trace), checks
of the compiled backward program (it repeats the forward's index checks), programs
handed to ``torchjax.export`` (no Python runs after them), and torch code traced by a
user's own ``jax.jit`` through ``torchjax.interop`` (no call to report after; use
``jax.experimental.checkify`` there). There, out-of-range indices follow jax's rules
(``x[idx]`` clamps, ``jnp.take`` fills NaN, scatters drop).
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from torchjax._compat.jax import trace_of
from torchjax._compat.torch import graph_task_id, queue_engine_callback
from torchjax.device import _stats
from torchjax.tensor import _errors, _tensor

_FOLD_AT = 64
_lock = threading.Lock()
_local = threading.local()
# code -> (exception type, message template, values are floats); codes index this list.
_TEMPLATES: list = []
_CODES: dict = {}
# Codes of the checks made at the op (``deferred=False``).
_AT_OP: set = set()
# [(bad, values, values, code)]: bool scalar, int64[2], float64[2], int32 scalar (arrays,
# NumPy values or ints).
_PENDING: list = []
_SYNC = [os.environ.get("TORCHJAX_SYNC_CHECKS", "") not in ("", "0")]
# Called at every synchronisation point before the queue is read: fused eager mode runs
# the recorded ops there, so their checks are queued (Note [Fused eager]).
BEFORE_SYNC: list = []


def set_sync_checks(enabled: bool) -> None:
    """Immediate mode on (``True``) or off: checks read their flag at the op and raise
    there, instead of at the next synchronisation point (Note [Device-side checks])."""
    _SYNC[0] = bool(enabled)


def sync_checks() -> bool:
    return _SYNC[0]


def _code(exc, template, isfloat, deferred) -> int:
    key = (exc, template, isfloat)
    code = _CODES.get((key, deferred))
    if code is None:
        with _lock:
            code = _CODES.get((key, deferred))
            if code is None:
                code = _CODES[key, deferred] = len(_TEMPLATES)
                _TEMPLATES.append(key)
                if not deferred:
                    _AT_OP.add(code)
    return code


def at_op(codes) -> bool:
    """Whether any of ``codes`` (ints) is a check made at the op."""
    return bool(_AT_OP) and any(c in _AT_OP for c in codes)


class NeedsValues(Exception):
    """Raised by ``concrete(x)`` while an eager op's executable is traced: the lowering
    needs ``x``'s values (a check not written with ``require``), so the call runs op by
    op instead (Note [Compiled lowerings])."""


def concrete(x) -> bool:
    """Whether ``x`` has values a check may read. False for a user's trace (the check is
    skipped, as documented); inside an eager op's trace raises ``NeedsValues``, so the
    op runs op by op and the check still runs."""
    if not isinstance(x, jax.core.Tracer):
        return True
    collector = getattr(_local, "collector", None)
    if collector is not None and collector.strict:
        raise NeedsValues
    return False


class Collector:
    """The checks of one trace of a cached executable (its extra outputs). ``strict``:
    ``concrete`` raises ``NeedsValues`` (an eager op's trace, which can run op by op
    instead); otherwise a check needing values is skipped, as in a user's trace."""

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.codes: list = []
        self.bads: list = []
        self.values: list = []
        self.depends: list = []


def collecting(strict: bool = True):
    """A context in which ``require`` adds to a fresh ``Collector`` (while tracing an
    eager op's executable; ``strict=False`` for a jax function's, which has no op-by-op
    path to fall back on)."""
    return _Collecting(strict)


class _Collecting:
    def __init__(self, strict):
        self.strict = strict

    def __enter__(self):
        self.prev = getattr(_local, "collector", None)
        _local.collector = self.collector = Collector(self.strict)
        return self.collector

    def __exit__(self, *exc):
        _local.collector = self.prev


class _Suppressed:
    def __enter__(self):
        self.prev = getattr(_local, "collector", None)
        _local.collector = None

    def __exit__(self, *exc):
        _local.collector = self.prev


def outside_collection():
    """A context where ``require`` sees no collector (a nested jit of a user's trace)."""
    return _Suppressed()


def _split(value):
    """(int64[2], float64[2], are floats) of a scalar or a pair of scalars: the values
    in the slots of their kind (the first one's), 0 in the other (every check has both,
    so that checks stack into one array each)."""
    pair = value if isinstance(value, tuple) else (value, 0)
    a, b = (jnp.asarray(v).reshape(()) for v in pair)
    if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_:
        ints = jnp.stack([a.astype(jnp.int64), b.astype(jnp.int64)])
        return ints, jnp.zeros((2,), jnp.float64), False
    floats = jnp.stack([a.astype(jnp.float64), b.astype(jnp.float64)])
    return jnp.zeros((2,), jnp.int64), floats, True


def require(bad, value, exc, template, *, deferred: bool = True, depends=None) -> None:
    """Report ``exc(message)`` if the device scalar ``bad`` is True (Note [Device-side
    checks]). ``bad``/``value`` may be jax arrays or numpy values; ``value`` a scalar or
    a pair; ``template`` a string with ``{value}`` (``{value2}``: the pair's second) or a
    function of the values returning the message. ``deferred=False``: a check every
    torch backend makes at the op, raised there (the audit in the Note). ``depends``:
    ``(static, arrays)`` that determine ``bad`` and ``value`` with the code (Note
    [Device checks of compiled programs], one check per distinct input), or None."""
    collector = getattr(_local, "collector", None)
    with jax.enable_x64(True):
        bad = jnp.asarray(bad, jnp.bool_).reshape(())
        ival, fval, isfloat = _split(value)
    code = _code(exc, template, isfloat, deferred)
    if collector is not None:
        collector.codes.append(code)
        collector.bads.append(bad)
        collector.values.append((ival, fval))
        collector.depends.append(depends)
        return
    _report([(bad, ival, fval, code)], [depends])


def _traced(entry) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in entry[:3])


def _report(entries, depends=None) -> None:
    """Checks ``[(bad, int values, float values, code)]`` made by an op: carried by the
    program being traced on this thread (Note [Device checks of compiled programs]), or
    queued; raised now where one is made at the op. ``depends``: each entry's
    ``(static, arrays)`` or None (``require``'s)."""
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink.take(entries, at_op([e[3] for e in entries]), depends)
        return
    if _traced(entries[0]) or _traced(entries[-1]):
        return  # a trace that carries no checks (Note [Device checks of compiled programs])
    add_pending(entries)
    if at_op([e[3] for e in entries]):
        raise_pending()


def add_pending(entries) -> None:
    """Queue checks ``[(bad, int values, float values, code)]`` (arrays, not read)."""
    with _lock:
        _PENDING.extend(entries)
        fold = len(_PENDING) >= _FOLD_AT
    if _SYNC[0]:
        raise_pending()
    elif fold:
        _fold()


def add_collected(codes, bads, values, depends=None) -> None:
    """Report the check outputs of one executable call (``codes`` from its trace)."""
    _report([(b, iv, fv, c) for c, b, (iv, fv) in zip(codes, bads, values)], depends)


@jax.jit
def _first_failure(bads, ivals, fvals, codes):
    bads = jnp.stack(bads)
    i = jnp.argmax(bads)  # the first failure in program order
    return jnp.any(bads), jnp.stack(ivals)[i], jnp.stack(fvals)[i], jnp.stack(codes)[i]


def _folded(entries):
    bads, ivals, fvals, codes = zip(*entries)
    with jax.enable_x64(True):
        # NumPy for the codes known on the host: no device op per code.
        codes = [np.int32(c) if isinstance(c, int) else c for c in codes]
        return _first_failure(list(bads), list(ivals), list(fvals), codes)


def _take_pending():
    with _lock:
        entries = list(_PENDING)
        _PENDING.clear()
    return entries


def _fold() -> None:
    # Many checks -> one (bad, values, code) on the device, in program order: no read.
    entries = _take_pending()
    if not entries:
        return
    entry = _folded(entries)
    with _lock:
        _PENDING.insert(0, entry)


def pending() -> int:
    """How many checks are queued (not yet read)."""
    return len(_PENDING)


def _message(template, values) -> str:
    if callable(template):
        return template(*values)
    return template.format(value=values[0], value2=values[1])


def raise_pending() -> None:
    """Read every queued check (one host transfer) and raise the first failure; a sync
    point calls this (Note [Device-side checks])."""
    for hook in BEFORE_SYNC:
        hook()
    if not _PENDING:
        return
    entries = _take_pending()
    _stats.count_host_read()
    for bad, ival, fval, code in jax.device_get(entries):
        if not bool(bad):
            continue
        code = int(code)
        exc, template, isfloat = _TEMPLATES[code]
        values = [float(v) for v in fval] if isfloat else [int(v) for v in ival]
        error = exc(_message(template, values))
        # A check made at the op quotes CPU's text, with no op added (Note [Device-side
        # checks]): the same from an op and from a compiled call.
        raise _errors.verbatim(error) if code in _AT_OP else error


def at_backward_op() -> None:
    """Called by a tpu op while checks are pending: inside a backward pass, have its
    end raise them (once per pass; Note [Device-side checks])."""
    task = graph_task_id()
    if task == -1 or getattr(_local, "backward_task", None) == task:
        return
    _local.backward_task = task

    def at_end():
        _local.backward_task = None
        raise_pending()

    queue_engine_callback(at_end)


def clear_pending() -> None:
    """Drop every queued check unread (a test harness between tests)."""
    _take_pending()


# Every tpu op looks at the pending list (one truth test) for the end of backward().
_tensor._PENDING_CHECKS = _PENDING
_tensor._at_backward_op = at_backward_op


class Outputs:
    """The device checks of an executable, returned beside its result: codes fixed by
    its trace (pytree metadata), flags and values as outputs."""

    __slots__ = ("codes", "bads", "values", "keys")

    def __init__(self, codes, bads, values, keys=None):
        self.codes, self.bads, self.values = codes, list(bads), list(values)
        # Per check: (static, positions of the executable's inputs) it depends on, or None.
        self.keys = keys


jax.tree_util.register_pytree_node(
    Outputs,
    lambda c: ((c.bads, c.values), (c.codes, c.keys)),
    lambda aux, children: Outputs(aux[0], *children, aux[1]),
)


def _positions(depends, inputs):
    """``depends`` (``(static, arrays)`` or None) with its arrays as positions in
    ``inputs``, or None where one of them is not an input as given."""
    if depends is None or inputs is None:
        return None
    static, arrays = depends
    at = {id(x): i for i, x in enumerate(inputs)}
    positions = tuple(at.get(id(a)) for a in arrays)
    return None if None in positions else (static, positions)


def outputs(collected, inputs=None):
    """The check outputs of a traced computation: ``Outputs``, or None when it made no
    check (most ops: None is an empty pytree, unflattened without a Python call on
    every eager op). ``inputs``: the computation's arguments, for the keys of the checks
    that say what they depend on (Note [Device checks of compiled programs])."""
    if not collected.codes:
        return None
    keys = tuple(_positions(d, inputs) for d in collected.depends)
    keys = keys if any(k is not None for k in keys) else None
    return Outputs(tuple(collected.codes), collected.bads, collected.values, keys)


def finish(result, inputs=None):
    """The result of an executable's ``(result, Outputs or None)``, its checks reported
    (queued, carried by the program being traced, or raised now). ``inputs``: the
    arguments the executable was called with (its checks' keys name their positions)."""
    out, checks = result
    if checks is not None:
        depends = None
        if checks.keys is not None and inputs is not None:
            depends = [
                None if k is None else (k[0], tuple(inputs[i] for i in k[1])) for k in checks.keys
            ]
        add_collected(checks.codes, checks.bads, checks.values, depends)
    return out


class Carried:
    """The checks made while a user's program is traced on this thread (Note [Device
    checks of compiled programs]): those whose arrays are concrete or tracers of
    ``trace``; a nested transformation's tracers cannot leave it and are dropped.
    ``at_op``: whether one of them is made at the op in eager."""

    def __init__(self, trace):
        self.trace = trace
        self.entries: list = []
        self.at_op = False
        # (code, static, ids of arrays) -> the arrays (held: their ids stay theirs).
        self.seen: dict = {}

    def take(self, entries, at_op: bool, depends=None) -> None:
        trace = self.trace
        for k, e in enumerate(entries):
            if all(trace_of(x) in (None, trace) for x in e[:3]):
                d = None if depends is None else depends[k]
                if d is not None:
                    key = (e[3], d[0], tuple(_identity(a) for a in d[1]))
                    if key in self.seen:
                        continue  # an equal check is carried already, earlier
                    self.seen[key] = d[1]
                self.entries.append(e)
                self.at_op = self.at_op or at_op

    def __enter__(self):
        self.prev = getattr(_local, "sink", None), getattr(_local, "collector", None)
        _local.sink, _local.collector = self, None
        return self

    def __exit__(self, *exc):
        _local.sink, _local.collector = self.prev

    def outputs(self) -> list:
        """The program's check outputs, ``[failed, int values, float values, code]``
        (the first failure in program order), or ``[]`` when it makes no check."""
        if not self.entries:
            return []
        if len(self.entries) == 1:  # nothing to fold: no argmax in the program
            bad, ival, fval, code = self.entries[0]
            with jax.enable_x64(True):
                return [jnp.asarray(bad), ival, fval, jnp.asarray(code, jnp.int32)]
        return list(_folded(self.entries))


# Concrete arrays up to this many elements are told apart by value, not identity.
_BY_VALUE = 4096


def _identity(array):
    """What tells ``array`` apart in a check's key: a tracer by identity, a small
    concrete array by value (a prefill's known positions are made afresh per layer,
    equal; read to the host once, while tracing), others by identity."""
    if isinstance(array, jax.core.Tracer) or getattr(array, "size", _BY_VALUE + 1) > _BY_VALUE:
        return id(array)
    value = np.asarray(array)
    return (value.shape, value.dtype.str, value.tobytes())


def carried(trace) -> Carried:
    """A context collecting the checks of the program traced in ``trace`` (a tracer's
    ``_trace``), for ``Carried.outputs`` (Note [Device checks of compiled programs])."""
    return Carried(trace)


def report_program(outputs, at_call: bool) -> None:
    """After a call of a compiled program: its check outputs (``Carried.outputs``'s)
    queued, or carried by an enclosing trace; read now when ``at_call`` (the program
    holds a check made at the op: Note [Device checks of compiled programs])."""
    if not outputs:
        return
    entry = tuple(outputs)
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink.take([entry], at_call)
        return
    if _traced(entry):
        return
    add_pending([entry])
    if at_call:
        raise_pending()
