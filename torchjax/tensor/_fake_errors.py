"""The error an op raises while torch.compile traces it: eager's, not the meta kernel's.

Note [Errors of ops traced with fake tensors]
Dynamo traces with fake JaxTensors (Note [JaxTensor under Dynamo] in _fake.py): an op
runs FakeTensorMode's meta kernel on the inner fakes. A call eager refuses is refused
there too, but worded by the meta kernel (``torch.mm`` of (2, 3) and (4, 5): "a and b must
have same reduction dim", where eager on tpu, as CPU, says "mat1 and mat2 shapes cannot
be multiplied (2x3 and 4x5)"), and FakeTensorMode first logs the failure with its whole
traceback at error level; Dynamo then wraps the exception in its own report. So a fake op
that raises runs once more as eager runs it, on abstract values: JaxTensors over
``jax.eval_shape`` tracers of the same shapes and dtypes, outside the trace's dispatch
modes, through the same handlers and checks as eager. When that run raises, its exception
(eager's type and text, the op named) is the one raised, and FakeTensorMode's log of the
meta failure, held back while the fake op ran, is dropped; when it does not (a refusal
that needs strides the abstract run does not have, a value it cannot read, a size that is
symbolic, a random op, whose key must not be drawn under a trace), the meta kernel's
error is raised and its log let through. Only the error path pays for this: a fake op
that succeeds costs a thread-local list.

A meta failure that Dynamo takes for a graph break (an output shape or value that depends
on data: ``ctc_loss``'s lengths; an op with no fake kernel) is left as it is, not
replaced: Dynamo then runs the op eagerly, outside the graph, where eager's check raises
at the call, plain, as CPU's torch.compile raises it (CPU's fake propagation meets the
same failure and breaks the graph there too). Replaced by eager's error, it would reach
Dynamo as a RuntimeError, which Dynamo wraps in its ``TorchRuntimeError`` instead. Other
eager errors stay wrapped, as CPU's compile wraps them (``torch.mv`` of mismatched sizes).

The hold is a ``logging.Filter`` on FakeTensorMode's logger, added on the first traced op
that runs here, recorded in Note [Process-wide changes] (torchjax/_patches.py); it
holds records only on a thread inside ``eager_errors``, every other record passes.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import jax
import torch

from torchjax import _patches
from torchjax._compat.torch import eager_dispatch, pytree
from torchjax._compat.torch_dynamo import fake_graph_breaks, fake_tensor_logger, is_fake_tensor

_HELD = threading.local()
_FILTER_NAME = "torch._subclasses.fake_tensor logger filter"


class _HoldMetaFailures(logging.Filter):
    """Holds FakeTensorMode's records on a thread inside ``eager_errors``."""

    def filter(self, record):
        held = getattr(_HELD, "records", None)
        if held is None:
            return True
        held.append(record)
        return False


def _install_filter() -> None:
    if _patches.is_recorded(_FILTER_NAME):
        return
    logger, hold = fake_tensor_logger(), _HoldMetaFailures()
    logger.addFilter(hold)
    _patches.record(
        _FILTER_NAME,
        why="hold FakeTensorMode's error log of a traced tpu op that eager refuses, whose "
        "error is raised in eager's words instead (Note [Errors of ops traced with fake "
        "tensors])",
        package="torch",
        written_for="2.13",
        undo=lambda: logger.removeFilter(hold),
    )


@contextlib.contextmanager
def eager_errors(func, args, kwargs):
    """Run a fake op; where it raises, raise eager's error for the call instead, if
    eager raises one (Note [Errors of ops traced with fake tensors])."""
    _install_filter()
    outer = getattr(_HELD, "records", None)
    _HELD.records = held = []
    try:
        yield
    except fake_graph_breaks():
        _HELD.records = outer
        _let_through(held)
        raise  # Dynamo breaks the graph; the op runs eagerly, raising at the call
    except Exception:
        _HELD.records = outer
        eager = eager_error(func, args, kwargs)
        if eager is not None:
            raise eager from None
        _let_through(held)
        raise
    else:
        _HELD.records = outer
        _let_through(held)


def _let_through(records) -> None:
    logger = fake_tensor_logger()
    for record in records:
        logger.handle(record)


def eager_error(func, args, kwargs) -> Exception | None:
    """The exception ``func`` raises in eager on tpu tensors of these arguments' shapes
    and dtypes, from a run on abstract values; None when that run succeeds or cannot be
    made (Note [Errors of ops traced with fake tensors])."""
    from torchjax.tensor import _errors, _fake
    from torchjax.tensor._tensor import wrap
    from torchjax.tensor.dtypes import to_jax_dtype

    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    places, avals = [], []
    for i, x in enumerate(leaves):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        if not isinstance(x, torch.Tensor):
            continue
        if x.device.type != _fake.DEVICE_TYPE:
            if is_fake_tensor(x):
                return None  # a fake tensor of another device: nothing to run it on
            continue  # a real CPU tensor, as eager gets it
        if any(isinstance(n, torch.SymInt) for n in x.shape):
            return None
        # Every tpu tensor, real ones too, becomes an abstract one: the run must not
        # write a traced value into a tensor that outlives it.
        places.append(i)
        avals.append(jax.ShapeDtypeStruct(tuple(x.shape), to_jax_dtype(x.dtype)))
    written = _fake._written(func._schema, args, kwargs)
    if any(isinstance(w, torch.Tensor) and w.device.type != _fake.DEVICE_TYPE for w in written):
        return None

    def run(*arrs):
        filled = list(leaves)
        for i, arr in zip(places, arrs):
            filled[i] = wrap(arr)
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        func(*call_args, **call_kwargs)

    with eager_dispatch():
        try:
            jax.eval_shape(run, *avals)
        except _errors.TraceError:
            return None  # eager would read values there: not a refusal of the call
        except Exception as error:  # noqa: BLE001 - eager's refusal, raised in its place
            return error
    return None
