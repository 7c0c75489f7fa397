"""Captured module calls: in fused eager mode a repeated tpu module call runs as one
cached program, with no per-op Python.

Note [Captured module calls]
Fused eager mode records every op of a forward (Note [Fused eager] in
torchjax/ops/fused.py); recording costs host time per op (__torch_dispatch__, the step
lookup, the wrapping of each result), and a large model's forward is hundreds of ops. A
module called again with the same signature runs the same ops, so in fused mode such a
call runs as one program traced from the module, as ``torchjax.jit`` would run it:

- Which calls. The outermost call of a tpu module (its first parameter, else its first
  buffer, is on tpu) on a thread in fused mode: calls made while a captured call traces
  or runs op by op are part of it, and a module that is not on tpu, or one made under a
  user's trace (``torchjax.jit``, ``jax.jit``: the trace is one program already), or
  one that needs an autograd graph under a user's ``saved_tensors_hooks`` (Note
  [Captured calls that need a graph]), runs as fused mode runs it, its inner calls
  included. The first call of a signature runs op by op in fused mode (a call made
  once, a prefill, never pays a trace and a compile); its second call traces, compiles
  and runs the program; later calls run it. Modules that define their own ``__call__`` are not seen.
- The signature is ``torchjax.jit``'s key (one ``Jitted`` per module, kept weakly:
  Note [State of a jitted function] in torchjax/compile/_state.py): the module's state
  (by layout, not identity: Note [Captured calls are keyed by layout]), its config and
  plain attributes (Note [A module's plain attributes are guards]), training flags,
  grad mode, torch's global modes, and the arguments' structure, shapes, dtypes,
  devices and non-tensor values. Outputs come back as the forward returns them (tuples,
  dicts, HF ``ModelOutput``); state the forward writes (a ``StaticCache``'s
  ``index_copy_``, a buffer's ``mul_().add_()``) is written back, its buffers donated
  under jit's rules (Note [Donation never takes the user's copy]).
  As under ``torchjax.jit``, the forward's Python runs only when it is traced: side
  effects on Python objects that are not guards (a counter in a list) happen once.
- Numbers. A ``torchjax.jit`` trace of a tiny Llama forward differs from eager in the
  last bit in float32 (XLA fuses a reduction with its producer, contracts a
  multiply-add: Note [Fusion keeps eager's numbers] in torchjax/ops/fusion_cuts.py). So
  a captured program is traced as fused mode's segment programs are built: every op
  that reaches its cached executable under the trace is entered as that segment
  program's node (torchjax/ops/fused_nodes.py): inlined when elementwise, as the branch
  of a conditional on a predicate input (True at run time, unknown to XLA) when not,
  its rewritable outputs leaving through an identity conditional; the program is
  compiled with ``COMPILER_OPTIONS``. The tiny Llama forward, repeated calls and
  StaticCache decode steps give eager's bits in float32 and bfloat16
  (tests/compile/test_captured.py), with the attention kernel ops a TPU chooses too
  (Note [A kernel op is an eager op] in torchjax/pallas/_op.py;
  tests/compile/test_captured_kernels.py). An op that runs off its cached executable (a
  handler computing in jnp op by op, such as batch norm's; a lowering run op by op)
  would be traced inline, where XLA fuses it with its neighbours: a trace whose jaxpr
  computes float values outside the nodes (``fused_nodes.float_ops_outside_nodes``;
  moves, conversions and exact operations such as max pass) is refused.
- Grad. A call that needs an autograd graph (grad mode on, a parameter or tensor
  argument requiring grad: a train step's forward) is captured too, its backward one
  more program: Note [Captured calls that need a graph].
- Fallback. A trace that fails (a host read or data-dependent branch in the forward,
  a data-dependent output shape, a refusal of torchjax.jit's) marks the signature
  uncapturable: that call and later ones with the signature run op by op in fused
  mode, and eager's own result or error is what the user sees (the forward's Python
  then ran twice for that call: once in the failed trace, whose tensor state is put
  back, once for real). A guard change (an attribute, a config value, a new shape) is a
  new signature: it runs op by op once, then traces. After ``MAX_SIGNATURES`` traced
  signatures the module stops being captured, with a ``RetraceWarning`` naming what
  changed last.
- The patch of ``nn.Module.__call__`` is in force only while fused mode is on in some
  thread (``fused.ACTIVE``): ``import torchjax`` and code outside fused mode run torch's
  own ``__call__``. Dynamo does not inline a ``__call__`` from torchjax's files, so
  ``torch.compile`` of a module with submodules inside a ``fused()`` block graph-breaks
  at each submodule call (and ``fullgraph=True`` refuses); outside fused mode it is
  untouched (left in place after the first fused block, the patch broke every later
  compile in the process). Making and undoing it costs tens of microseconds per
  ``fused()`` block; a module call in fused mode costs one more Python call and a
  thread-local read.
- Threads. Which call is outermost is per thread; tracing binds the module's storages
  per thread (Note [Bindings are per thread]), so another thread calling the same
  module meanwhile runs on its real arrays, and traces are serialised (``trace_lock``):
  a second thread missing the same signature waits and runs the program the first
  traced.
- Counters: ``torchjax.stats()`` ``captured_calls`` (calls run by a captured program),
  ``capture_traces`` and ``capture_refusals`` (signatures refused: a failed trace, or a
  backward asked for a graph). A refusal is silent (the call runs op by op, with
  eager's result), so ``capture_refusal_reasons`` keeps why: per module class name, the
  latest refusal's exception as ``"TraceError: <message>"``, whose message names what
  the trace met (the float operations a forward or a backward would compute outside
  the nodes, the error its trace raised), or that its backward was asked for a graph.
  Reset with the counters by ``torchjax.reset_stats()``.

Note [Captured calls that need a graph]
Left op by op, a train step's forward and backward are hundreds of recorded ops, each
paying host time (a tiny Llama AdamW step in fused mode took several times
``torchjax.jit``'s: docs/performance.md). So a call that needs a graph runs
``torchjax.jit``'s differentiable path (Note [The compiled VJP is torch's autograd] in
torchjax/compile/_autograd.py): traced with grad mode on, torch records the call's
graph over the trace; the forward
program also returns the values the graph saved; right after the forward, torch's own
backward of that graph (``backward()`` over the saved values) is traced into a second
program. Both are built as the forward alone is (every op a fused eager node, one
predicate input, ``COMPILER_OPTIONS``), so a call's outputs carry one autograd node and
``backward()`` runs one program, its gradients accumulated into ``.grad`` by the engine
as eager's are: the loss, every gradient and an AdamW or SGD step give eager's bits in
float32 and bfloat16 (tests/compile/test_captured_grad.py; Note [Captured traces leave
the view limits alone] in torchjax/ops/fused_nodes.py). What the path carries from jit:
hooks on parameters run once, when the engine hands them the program's gradients;
``retain_graph`` works and a second backward without it raises torch's error;
tensor arguments requiring grad (leaves or not) get theirs; a parameter or argument
the graph saved and written in place before ``backward()`` raises torch's version error
(Note [Outputs the backward saved]); two calls before one backward accumulate as two
eager calls do; which parameters require grad (frozen layers) is part of the signature.

Refused (the signature runs op by op, counted in ``capture_refusals``, the reason kept
in ``capture_refusal_reasons``: Note [Captured module calls]), so a captured gradient
is never computed another way than eager's: a backward torch's graph cannot give as
nodes, where ``torchjax.jit`` would take ``jax.vjp`` of the forward (an intermediate
kept on ``ctx``, a ``torchjax.jax_function``'s pullback, a random draw in the
backward, a saved-tensor hook refused), one whose trace raised, or one computing a
float outside the nodes; and a signature whose backward was asked for a graph (Note
[Double backward of a captured call] in torchjax/compile/_captured_grad.py). A kernel
op's backward (the flash kernel's, SDPA's exact op's, ``ragged_dot``'s) is an eager op
like its forward, traced as a node (Note [Kernel op backward] in
torchjax/pallas/_op.py): with the attention a TPU chooses, a train step is captured.
A call made under a user's ``saved_tensors_hooks`` (``save_on_cpu``) runs op by op
without a refusal: the hooks must see the call's saved tensors, which a captured call
keeps inside its programs.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref

import torch

from torchjax import _budget, _patches
from torchjax._compat import torch_modules
from torchjax._compat.jax import trace_state_clean
from torchjax._compat.torch import pytree, saved_tensors_hooks_active
from torchjax.compile import _state
from torchjax.compile._call import Call, Ref, flatten_args
from torchjax.compile._captured_grad import CapturedVJPCall
from torchjax.compile._jit import Jitted, RetraceWarning
from torchjax.compile._keys import value_key
from torchjax.device import _stats
from torchjax.ops import fused as _fused

# Traced signatures per module before it stops being captured.
MAX_SIGNATURES = 8
# Signatures seen once kept per module (a DynamicCache decode: new shapes every token).
MAX_SEEN = 256


class _Local(threading.local):
    inside = False  # a captured (or declined) outermost call is running on this thread


_local = _Local()


class _ModuleJitted(Jitted):
    """The ``torchjax.jit`` of one module's calls, holding the module weakly (the
    module's captures live in a weak dictionary keyed by the module), its calls keyed by
    the layout of their state rather than its identity (Note [Captured calls are keyed
    by layout])."""

    captured = True
    vjp_call = CapturedVJPCall

    def refuse(self, key) -> None:
        """Run signature ``key`` op by op from now on (its backward was asked for a
        graph: Note [Double backward of a captured call])."""
        if key in self.refused:
            return
        self.refused.add(key)
        name = self.module_name
        _stats.CAPTURED.refused(
            name, f"{name}: its backward was asked for a graph (create_graph=True)"
        )
        entry = self._entries.pop(key, None)
        if entry is not None:
            _budget.forget(entry)

    def op_by_op(self, args, kwargs):
        """The module called as fused eager runs it, nothing inside it captured (Note
        [Double backward of a captured call] in torchjax/compile/_captured_grad.py)."""
        inside = _local.inside
        _local.inside = True
        _state.python_ran()  # Note [A module walked once within a block] in _state.py
        try:
            return self.fn(*args, **kwargs)
        finally:
            _local.inside = inside

    @property
    def fn(self):
        return self._ref()

    @fn.setter
    def fn(self, module):
        self._ref = weakref.ref(module)
        self.module_name = type(module).__name__

    def _lookup(self, args, kwargs):
        # Jitted._lookup with the key by layout (looked up by identity first, every
        # call would miss and search the modules for new plain attributes).
        flat, spec = flatten_args(args, kwargs)
        call = Call(self, flat, spec, {}, (args, kwargs))
        _key_by_layout(call)
        entry = self._entries.get(call.key)
        if entry is None and self._new_attributes(call.walk.modules):
            call = Call(self, flat, spec, {}, (args, kwargs))  # with what they hold
            _key_by_layout(call)
            entry = self._entries.get(call.key)
        return call, entry

    def _trace(self, call):
        entry = super()._trace(call)
        entry.refs = []  # keyed by layout: alive whatever storages it was traced with
        return entry


# Note [Captured calls are keyed by layout]
# torchjax.jit keys a call by the identity of its state storages and of its non-tensor
# arguments (a Cache object is one). ``generate`` makes a new StaticCache per call, so
# every generate traced its decode step again (and after MAX_SIGNATURES calls the model
# was no longer captured), and each key held its cache alive. A captured call's key
# takes instead the layout of its state: how many storages the walk found, each state
# tensor's storage (by position in the walk), size, stride and offset, besides the
# storages' shapes and dtypes already there; and a transformers Cache argument of fixed
# size (``is_compileable``: StaticCache and its kin) by its class and the plain values
# (ints, floats, bools, strings, dtypes) of it and of its layers. A DynamicCache stays
# keyed by identity: its steps have new shapes every token, and matched across
# ``generate`` calls every step of the second call would trace (and the module would
# soon stop being captured). The program takes the state's arrays as inputs in walk
# order, so a call with the same layout runs it correctly on other storages (a new
# cache, a parameter replaced by one of the same shape); other non-tensor arguments
# stay keyed by identity.
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _key_by_layout(call) -> None:
    index = {id(s): i for i, s in enumerate(call.storages)}
    layout = tuple((index[id(t._storage)], t._size, t._stride, t._offset) for t in call.walk.every)
    sig = list(call.sig)
    sig[1] = tuple(_by_layout(v) for v in sig[1])
    sig[5] = layout
    call.sig = call.key = tuple(sig)


def _by_layout(v):
    obj = getattr(v, "obj", None) if type(v) is Ref else None
    if obj is None or not _is_cache(obj) or not getattr(obj, "is_compileable", False):
        return v  # a DynamicCache grows: keyed by identity, its steps never repeat
    parts = [obj, *getattr(obj, "layers", ())]
    return (
        type(obj),
        tuple(
            tuple((k, value_key(x)) for k, x in vars(p).items() if isinstance(x, _PLAIN))
            for p in parts
        ),
    )


def _is_cache(obj) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(obj, cache_utils.Cache)


class _Captures:
    """What capturing knows about one module's calls."""

    __slots__ = ("jitted", "seen", "refused", "off")

    def __init__(self, module):
        # No RetraceWarning of its own: MAX_SIGNATURES stops capturing first.
        self.jitted = _ModuleJitted(module, warn_after=MAX_SIGNATURES + 1)
        self.seen: set = set()  # signatures called once (run op by op)
        # Signatures whose trace failed, or whose backward was asked for a graph.
        self.refused = self.jitted.refused = set()
        self.off = False


_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _make_call(original):
    local = _local
    active = _fused.ACTIVE
    capturing = _fused.capturing

    def __call__(self, *args, **kwargs):
        if active[0] and not local.inside and capturing():
            return _outermost(original, self, args, kwargs)
        return original(self, *args, **kwargs)

    return __call__


_PATCHED = [False]


def _set_patch(active: bool) -> None:
    # Made while fused mode is on anywhere, undone when it turns off: Dynamo refuses to
    # inline a ``__call__`` from torchjax's files, so a patch left in place broke every
    # later torch.compile of a module with submodules in the process (a graph break per
    # call, an error under fullgraph). Setting the class attribute costs tens of
    # microseconds per fused() block (transformers' many nn.Module subclasses).
    if active and _patches.uninstalled():
        return
    if active != _PATCHED[0]:
        _PATCHED[0] = active
        torch_modules.set_module_call(_make_call if active else None)


def install() -> None:
    """Patch ``nn.Module.__call__`` whenever fused mode may be on (from now on)."""
    _fused.on_active(_set_patch)


def _on_tpu(module) -> bool:
    for t in module.parameters():
        return t.device.type == "tpu"
    for t in module.buffers():
        return t.device.type == "tpu"
    return False


def _needs_grad(module, args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))
    )


# What a failed trace raises (Note [Captured module calls]): torchjax's TraceError and
# refusals (RuntimeError), jax's tracer conversion errors (TypeError), a missing
# lowering. Any of them, or the user's own error, is raised again, if at all, by the op
# by op run that follows.
_TRACE_FAILURES = (RuntimeError, TypeError, ValueError, NotImplementedError, IndexError)


def _outermost(original, module, args, kwargs):
    local = _local
    local.inside = True
    try:
        if (
            not trace_state_clean()  # under a user's trace (torchjax.jit, jax.jit)
            or not _on_tpu(module)
            # Note [Captured calls that need a graph]: a user's saved-tensor hooks see
            # the saved tensors of an op by op call only.
            or (saved_tensors_hooks_active() and _needs_grad(module, args, kwargs))
        ):
            return original(module, *args, **kwargs)
        caps = _CAPTURES.get(module)
        if caps is None:
            with _LOCK:
                caps = _CAPTURES.get(module)
                if caps is None:
                    caps = _CAPTURES[module] = _Captures(module)
        if caps.off:
            return original(module, *args, **kwargs)
        return _call(caps, original, module, args, kwargs)
    finally:
        local.inside = False


def _call(caps, original, module, args, kwargs):
    jitted = caps.jitted
    try:
        call, entry = jitted._lookup(args, dict(kwargs))
        key = call.key
        hash(key)
    except TypeError:
        # An argument torchjax.jit cannot key on (an unhashable static value).
        return original(module, *args, **kwargs)
    if entry is not None:
        jitted.cache_hits += 1
        _stats.CAPTURED.calls += 1
        return jitted._run(call, entry, args, kwargs)
    if key in caps.refused or key not in caps.seen:
        if len(caps.seen) >= MAX_SEEN:  # signatures that never repeat (growing shapes)
            caps.seen.clear()
        caps.seen.add(key)
        out = original(module, *args, **kwargs)
        if key not in caps.refused and torch.is_grad_enabled():
            _watch_double_backward(jitted, key, out)
        return out
    if jitted.trace_count >= MAX_SIGNATURES:
        caps.off = True
        warnings.warn(
            f"torchjax fused eager: {type(module).__name__} traced {jitted.trace_count} "
            f"signatures of its calls (the last because {jitted.last_retrace_reason}); "
            "its calls run op by op from now on. Keep shapes, dtypes and non-tensor "
            "arguments fixed, or use torchjax.jit.",
            RetraceWarning,
            stacklevel=4,
        )
        return original(module, *args, **kwargs)
    traces = jitted.trace_count
    saved = _attributes(call.static)
    try:
        out = jitted(*args, **kwargs)
    except _TRACE_FAILURES as e:
        _put_back(saved)
        caps.refused.add(key)
        _stats.CAPTURED.refused(jitted.module_name, f"{type(e).__name__}: {e}")
        return original(module, *args, **kwargs)
    if jitted.trace_count > traces:
        _stats.CAPTURED.traces += jitted.trace_count - traces
    _stats.CAPTURED.calls += 1
    return out


def _watch_double_backward(jitted, key, out) -> None:
    """Refuse signature ``key`` if the graph of ``out`` (its op by op call's outputs) is
    differentiated with ``create_graph=True`` (Note [Double backward of a captured
    call] in torchjax/compile/_captured_grad.py)."""
    ref = weakref.ref(jitted)

    def prehook(grad_outputs):
        if torch.is_grad_enabled():  # the engine runs a create_graph pass with it on
            j = ref()
            if j is not None:
                j.refuse(key)

    for t in pytree.tree_leaves(out):
        fn = t.grad_fn if isinstance(t, torch.Tensor) else None
        if fn is not None:
            fn.register_prehook(prehook)


# Note [Attributes a failed capture trace set]
# A trace that fails has run part of the forward's Python: torchjax.jit puts back the
# state's tensors (Note [State after a trace whose program does not run]), but not the
# attributes the code assigned. A StaticCache's layers allocate their tensors at their
# first update (``lazy_initialization``: ``self.keys = torch.zeros(...)``,
# ``is_initialized = True``): a prefill whose trace failed left the cache initialized
# with the trace's tensors, and the op-by-op run that followed wrote the wrong cache. So
# the plain attributes (``__dict__``) of the call's non-module object arguments, and of
# a Cache's layers, are saved before a capture trace and put back if it fails.
def _attributes(static) -> list:
    saved = []
    for v in static:
        obj = getattr(v, "obj", None) if type(v) is Ref else None
        if obj is None or isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
            continue
        for o in (obj, *(getattr(obj, "layers", ()) if _is_cache(obj) else ())):
            saved.append((o, dict(vars(o))))
    return saved


def _put_back(saved) -> None:
    for o, attrs in saved:
        d = vars(o)
        d.clear()
        d.update(attrs)
