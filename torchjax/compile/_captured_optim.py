"""Captured optimizer steps: in fused eager mode a repeated ``optimizer.step()`` on tpu
parameters runs as one cached program, the numbers torch computes on the host for it
(bias corrections, learning rates) its inputs.

Note [Captured optimizer steps]
In fused eager mode with captured calls (Note [Captured module calls] in
torchjax/compile/_captured.py) a train step's forward and backward are one program
each; ``opt.step()`` of torch's foreach AdamW was still eight recorded foreach nodes
(Note [Recorded foreach ops]) and a segment run: recording each node looks at every
element of its lists (a tiny Llama: 21 parameters, about 270 element reads, 150 writes
of pending values, 1.5 ms per step on CPU), and the segment program took each Python
number of the step (47 for AdamW) as an input of its own, a transfer to the device each.
So a step that repeats its signature is replayed instead:

- Which steps. ``Optimizer.step`` of an optimizer whose parameters are all tpu tensors,
  without a closure, on a thread where fused mode captures, outside a trace and outside
  a captured module call. Seen through torch's global optimizer step hooks, registered
  while fused mode is on in some thread (torchjax/_patches.py). torch's own Python runs
  as always: it computes the host numbers (``1 - beta1 ** step`` on the CPU step
  counters) and calls the ``_foreach_*`` ops. The optimizer's path is torch's choice
  (foreach for tpu parameters, Note [tpu parameters take torch.optim's foreach path]):
  never switched to the capturable path, whose bfloat16 numbers differ from eager's.
- The signature: the layout (size, strides, offset, dtype, device, storage) of every
  parameter, gradient and tpu state tensor, the CPU state tensors' shapes and dtypes,
  the other state values, and the param groups' values; a float there by whether it is
  zero only (``weight_decay != 0`` picks ops; ``lr`` under a schedule changes every
  step and is an input). The first step of a signature is recorded as fused mode
  records it, into a segment of its own, and learned (torchjax/compile/_step_tape.py):
  each compiled foreach call described (its overload, static arguments, which walked
  tensor or which earlier result each list element is, its Python numbers in the order
  the recorded node took them) and checked against the segment (one node per call,
  every input a walked tensor's array or one of those numbers, every value the program
  returns held by a walked tensor the step wrote), then run as the learned program
  (``fused_run.close_with``: compiled now, in place of the segment's program). A step that
  creates the state is not learned (its factory ops are foreign), so an optimizer's
  second step is the first learned and its third the first replayed; at most
  ``MAX_SIGNATURES`` are learned per optimizer.
- Replay. Before torch's Python runs, the inputs' arrays are taken and each written
  storage gets a deferred value in place of its array. Each foreach call is described
  again and must equal the learned description (else see Fallback); its numbers join
  two vectors (float64, int64), and it returns tensors over placeholder storages (its
  in-place writes wait). After the step, one program runs: the learned segment's nodes
  (torchjax/ops/fused.py ``segment_function``: every node as fused mode replays it, so
  eager's bits) on the arrays and the two vectors, its outputs written into the
  deferred storages. A step is one dispatch and one transfer of host numbers; counted
  in ``torchjax.stats()["captured_steps"]``. The old values of what it writes (the
  parameters, the moments) are donated where nothing else holds them, as a fused
  segment's dead inputs are (Note [Fused segments donate their dead inputs] in
  torchjax/ops/fused_run.py), the program's outputs ordered as its donated inputs so
  that each aliases its own new value: a 1.1B model's step would otherwise hold them
  twice. A
  program that does not fit in device memory (and consumed nothing) takes the fallback
  below: the calls run as recorded ones, whose segment may run op by op (Note [A
  segment that fails as one program runs op by op]); at the learned step the recorded
  segment runs as fused mode runs it, and the signature is refused.
- Fallback. The calls taped so far run as recorded foreach calls, in order, on the
  arrays the deferred storages held, and their placeholders take the results, whenever
  the step does something else: a foreach call that differs (a branch taken on a
  float), another tpu op on this thread (torch's Python, or the optimizer's own step
  hooks: a watch on every op while the step runs), a read of a deferred storage or a
  placeholder from anywhere (an array read through its storage: another thread,
  ``torchjax.to_jax``), a step that raised (the next optimizer step's hook), or a
  placeholder still referenced when the step ends. The signature is then refused
  (``captured_step_refusals``) and its later steps run as fused mode runs them. The
  results are the same either way: eager's.
- Not captured: lists holding views, CPU tensors, ``None`` or a tensor of numbers,
  traced floats (``torch.SymFloat``), a step that records anything but its foreach calls
  (a state created, a host read), sharded arrays, tensors sharing a storage. A learned
  step holds its executables; its program is an entry of the executable budget.
- Threads. A step is captured on the thread that calls it; a read of a deferred
  storage from another thread runs the fallback there, under the step's lock. The
  fallback run from inside a trace (a step that raised, then a ``torchjax.jit`` call
  reading a parameter) runs on a thread of its own, so its values are concrete.
"""

from __future__ import annotations

import threading
import weakref

import torch

from torchjax import _patches
from torchjax._compat.jax import trace_state_clean
from torchjax._compat.torch_optim import set_step_hooks
from torchjax.compile import _captured
from torchjax.compile._keys import value_key
from torchjax.compile._step_tape import Tape
from torchjax.device import _stats
from torchjax.ops import foreach_compiled as _foreach
from torchjax.ops import fused as _fused
from torchjax.tensor import _tensor
from torchjax.tensor._tensor import JaxTensor

# Learned signatures per optimizer, and refused ones kept per optimizer.
MAX_SIGNATURES = 8
MAX_REFUSED = 256

_NO = object()  # a value the signature cannot hold: not captured


class _Captures:
    """What capturing knows about one optimizer's steps."""

    __slots__ = ("entries", "refused", "__weakref__")

    def __init__(self):
        self.entries: dict = {}  # signature -> its Learned step
        self.refused: set = set()

    def refuse(self, key) -> None:
        """Steps of signature ``key`` run as fused mode runs them from now on; counted
        where it had been learned."""
        if key in self.refused:
            return
        if len(self.refused) >= MAX_REFUSED:
            self.refused.clear()
        self.refused.add(key)
        learned = self.entries.pop(key, None)
        if learned is not None:
            _stats.CAPTURED.step_refusals += 1
            learned.forget()


_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


# -- the signature -----------------------------------------------------------------------


def _hyper_key(v):
    t = type(v)
    if t is float:
        return (float, v == 0.0)
    if t in (tuple, list):
        keys = tuple(_hyper_key(x) for x in v)
        return _NO if _NO in keys else (t, keys)
    if isinstance(v, torch.Tensor):
        return _NO
    if t in (bool, int, str, type(None), torch.dtype):
        return value_key(v)
    return (t, id(v))


def _tensor_key(t):
    s = t._storage
    return (t._size, t._stride, t._offset, t.dtype, t._device_index, s.__class__, s.shape)


def _walk(opt):
    """(walk, signature): every tpu tensor the step may read or write (each parameter,
    its gradient, its tpu state), in order, and the signature (Note [Captured optimizer
    steps]); (None, None) when the step is not captured."""
    walk, key = [], []
    state = opt.state
    for group in opt.param_groups:
        hyper = []
        for k, v in group.items():
            if k != "params":
                h = _hyper_key(v)
                if h is _NO:
                    return None, None
                hyper.append((k, h))
        params = []
        for p in group["params"]:
            if p.__class__ is not JaxTensor:
                return None, None
            walk.append(p)
            g = p.grad
            if g is not None:
                if g.__class__ is not JaxTensor:
                    return None, None
                walk.append(g)
                g = _tensor_key(g)
            items = []
            for name, v in (state.get(p) or {}).items():
                if v.__class__ is JaxTensor:
                    walk.append(v)
                    items.append((name, _tensor_key(v)))
                elif isinstance(v, torch.Tensor):
                    if v.device.type != "cpu":
                        return None, None
                    items.append((name, v.shape, v.dtype))  # host numbers: not keyed
                else:
                    h = _hyper_key(v)
                    if h is _NO:
                        return None, None
                    items.append((name, h))
            params.append((_tensor_key(p), g, tuple(items)))
        key.append((tuple(hyper), tuple(params)))
    return walk, tuple(key)


# -- the hooks -----------------------------------------------------------------------------


def _pre(opt, args, kwargs) -> None:
    tape = _foreach.TAPE.current
    if tape is not None:
        tape.abandon()
    if (
        not _fused.capturing()
        or _captured._local.inside
        or not trace_state_clean()
        or len(args) != 1
        or any(v is not None for v in kwargs.values())  # a closure runs a forward
        or getattr(_tensor.HOOK, "fn", None) is not None
    ):
        return
    caps = _CAPTURES.get(opt)
    if caps is None:
        with _LOCK:
            caps = _CAPTURES.setdefault(opt, _Captures())
    walk, key = _walk(opt)
    if key is None:
        return
    try:
        entry = caps.entries.get(key)
    except TypeError:  # an unhashable group value
        return
    if entry is None and (key in caps.refused or len(caps.entries) >= MAX_SIGNATURES):
        return
    tape = Tape(opt, caps, key, walk, entry)
    if not tape.start():
        tape.end()
        if entry is None:
            caps.refuse(key)


def _post(opt, args, kwargs) -> None:
    tape = _foreach.TAPE.current
    if tape is not None and tape.opt is opt:
        learned = tape.finish()
        if learned is not None and len(tape.caps.entries) < MAX_SIGNATURES:
            tape.caps.entries[tape.key] = learned


def _set_hooks(active: bool) -> None:
    if active and _patches.uninstalled():
        return
    if active:
        set_step_hooks(_pre, _post)
    else:
        set_step_hooks(None, None)


def install() -> None:
    """Register the optimizer step hooks whenever fused mode may be on (from now on)."""
    _fused.on_active(_set_hooks)
