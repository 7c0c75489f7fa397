"""``torch.compile(backend="tpu")``: Dynamo's FX graphs run as jax.jit programs.

Dynamo traces the model with fake JaxTensors (Note [JaxTensor under Dynamo]) and hands
each captured graph here. The graph is a torch-level program over tpu tensors, so
running it on real JaxTensors under torchjax.jit traces it into one jax program: the
same machinery as ``torchjax.jit`` (one executable per input signature, parameters and
buffers as inputs, written buffers donated and written back, random keys threaded
through calls). Graph breaks give several graphs, each compiled on its own, with Python
running between them as usual.

Training: when grad mode is on and parameters require grad, the compiled graph is a
differentiable call whose backward is the compiled VJP of the same jax program (see
torchjax.jit), so ``loss.backward()`` after a compiled forward fills ``.grad`` without
AOTAutograd's partitioner.

The backend is found by name through the ``torch_dynamo_backends`` entry point
(pyproject.toml), so ``import torchjax`` does not import Dynamo.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import warnings

import jax
import torch

from torchjax import _patches
from torchjax._compat.torch_dynamo import (
    dynamo_first_compile,
    dynamo_frame_id,
    dynamo_never_trace,
    dynamo_optimizer_variable_class,
    dynamo_skip_package,
    fake_tensor_mode_class,
)
from torchjax.compile import _custom_functions, _host_parts
from torchjax.compile._capturable import make_capturable
from torchjax.compile._jit import DynamicShapesWarning, Jitted
from torchjax.ops import traced_scalars
from torchjax.tensor._errors import DataDependentError
from torchjax.tensor._tensor import JaxTensor


def _entry_point_codes():
    """Code of every function and method in torchjax: where C++ calls in (dispatch,
    PrivateUse1 kernels, device guard) and where user code calls in (jax_function,
    torchjax.jit, to_jax): all of it, and all the jax code below it, runs as plain
    Python; user code calling it graph-breaks there, as for any skipped library."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchjax") or module is None:
            continue
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != name:
                continue
            members = vars(obj).values() if inspect.isclass(obj) else (obj,)
            for m in members:
                m = getattr(m, "__func__", m)
                code = getattr(m, "__code__", None)
                if code is not None:
                    yield code


# Loaded when torch.compile first looks the backend up, so only processes that use it
# pay (once) for this: Dynamo never compiles torchjax's frames, nor anything they call.
def _install_skip_rules() -> None:
    undo_skip = dynamo_skip_package("torchjax")
    codes = list(_entry_point_codes())
    for code in codes:
        dynamo_never_trace(code)

    def undo():
        undo_skip()
        for code in codes:
            dynamo_never_trace(code, undo=True)

    _patches.record(
        "Dynamo skip rules for torchjax",
        why="torchjax's frames (dispatch, device guard, kernels) run as plain Python",
        package="torch",
        written_for="2.13",
        undo=undo,
    )


_install_skip_rules()


# Note [No tpu constants in fake tracing]
# When every input of an op is a constant (``torch.tensor(4)`` made in the traced code),
# FakeTensorMode runs the op for real and turns its output into a constant FakeTensor.
# ``torch.tensor(4).to("tpu")`` then gives a real tpu tensor, which the fake mode can only
# convert through ``__tensor_unflatten__``, into a fake JaxTensor that is not a
# FakeTensor: its constant assertion failed, and with it torch.compile of every model
# whose cache moves a Python-made tensor to tpu in forward (transformers' sliding-window
# and chunked caches). A tpu result is never made a constant; the op is traced as any
# other, which is what the graph needs anyway (the backend runs it).
def _install_constant_rule() -> None:
    FakeTensorMode = fake_tensor_mode_class()

    from torchjax.tensor._tensor import JaxTensor

    original = FakeTensorMode.may_turn_const

    def may_turn_const(self, t):
        return not isinstance(t, JaxTensor) and original(self, t)

    _patches.replace_attr(
        FakeTensorMode,
        "may_turn_const",
        may_turn_const,
        name="FakeTensorMode.may_turn_const",
        why="a real tpu tensor made from constants is traced, not folded into a constant",
        package="torch",
        written_for="2.13",
    )


_install_constant_rule()


# Note [Compiled optimizers are capturable on tpu]
# Dynamo traces an optimizer's step as capturable always (its traced param groups say
# ``capturable=True``), and switches the real groups to capturable only where every
# parameter is on CUDA or XPU and the state is not made yet, so that the state is made
# on the device. On tpu the state stayed a non-capturable one on CPU while the traced code
# took the capturable branch; on a recompile Dynamo moves ``step`` to the parameters'
# device and NAdam's ``mu_product *= mu`` mixed a CPU tensor with a tpu one (a crash of
# every NAdam whose learning rate or betas change). An optimizer whose parameters are all
# on tpu is switched as CUDA's are, its existing state moved to the device with it
# (compile/_capturable.py), as ``torchjax.jit`` does.
def _install_capturable_rule() -> None:
    OptimizerVariable = dynamo_optimizer_variable_class()
    original = OptimizerVariable.__dict__["_set_capturable"]

    def _set_capturable(self, tx):
        params = [p for group in self.value.param_groups for p in group.get("params", [])]
        if params and all(isinstance(p, JaxTensor) for p in params):
            make_capturable(self.value)
        return original(self, tx)

    _patches.replace_attr(
        OptimizerVariable,
        "_set_capturable",
        _set_capturable,
        name="Dynamo OptimizerVariable._set_capturable",
        why="an optimizer of tpu parameters is made capturable, as one of CUDA parameters",
        package="torch",
        written_for="2.13",
    )


_install_capturable_rule()

# Note [Backend counters outlive their graphs]
# ``stats`` is read before and after a piece of code to count what it compiled. Graphs
# die when Dynamo resets or recompiles, so a sum over the live graphs' own counters could
# fall between two reads (a collected graph takes its traces with it). The counters are
# totals kept here instead, bumped by each graph's call.
_TOTALS = {"graphs": 0, "traces": 0, "cache_hits": 0}


def backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """The "tpu" Dynamo backend: the graph as a torchjax.jit-compiled callable.

    ``mode`` and ``options`` (``torch.compile(..., mode=..., options=...)``) are accepted
    and ignored: they name inductor settings, XLA has its own. transformers' generation
    ``CompileConfig`` passes ``mode="reduce-overhead"`` by default.

    Returns a function taking the graph's inputs (tpu tensors, and Python ints for
    symbolic sizes when Dynamo marks dimensions dynamic: each distinct size is then one
    more compiled executable) and returning its outputs. ``run.static_floats`` is None
    while the graph's Python floats are traced values, else why they are static
    (Note [Traced Python floats] in torchjax/ops/traced_scalars.py).
    """
    scalars, floats = _scalars_as_values(gm, example_inputs)
    dynamo_gm = gm
    gm, host_attrs = _host_attributes_as_inputs(gm)
    host_attrs = [operator.attrgetter(t) for t in host_attrs]
    _custom_functions.replace_in(gm)  # Note [Custom functions in Dynamo graphs]
    host = _host_parts.host_nodes(gm)
    # Each compiled part runs its data-dependent ops eagerly (Note [Data-dependent ops in
    # compiled graphs]); while the floats are traced values, a trace needing values
    # is traced again with static numbers first (``run`` below).
    graph = _host_parts.Graph(
        lambda part: Jitted(part, warn_after=16),
        may_split=lambda: not floats or run.static_floats is not None,
    )
    if host:  # Note [Host copies in compiled graphs]
        call, parts = _host_parts.split(gm, host, graph.part)
    else:
        call = graph.part(gm)
        parts = [call]
    _TOTALS["graphs"] += 1
    static = _floats_stay_static(host, example_inputs) if floats else None
    frame = dynamo_frame_id(dynamo_gm) if _has_symbolic_sizes(example_inputs) else None
    if frame is not None and dynamo_first_compile(dynamo_gm):
        _WARNED_FRAMES.discard(frame)  # a new function (ids restart at Dynamo's reset)

    def counted(args):
        # by identity: a part split during the call has new programs (counted from 0)
        before = {id(p): (p, p.trace_count, p.cache_hits) for p in _programs(parts)}
        try:
            return call(*args)
        finally:
            for p in _programs(parts):
                _, traces, hits = before.get(id(p), (p, 0, 0))
                _TOTALS["traces"] += p.trace_count - traces
                _TOTALS["cache_hits"] += p.cache_hits - hits
            if frame is not None and frame not in _WARNED_FRAMES:
                _warn_per_shape(frame, _programs(parts))

    def run(*args):
        if scalars or floats:
            args = list(args)
            for i in scalars:
                args[i] = args[i].item()  # a CPU scalar: no device read
            if run.static_floats is not None:
                for i in floats:
                    args[i] = args[i].item()
        if host_attrs:
            args = (*args, *(get(dynamo_gm) for get in host_attrs))
        if not floats or run.static_floats is not None:
            return counted(args)
        try:
            return counted(args)
        except _NEEDS_STATIC as error:
            # Nothing ran: the trace failed. Traced again with the numbers as static
            # values, as before (Note [Traced Python floats]).
            run.static_floats = f"{type(error).__name__}: {error}"
            args = list(args)
            for i in floats:
                args[i] = args[i].item()
            return counted(args)

    # The trace counter, for tests and users who ask (of the first compiled part where
    # the graph was split; None where all of it runs on the host).
    programs = _programs(parts)
    run.jitted = programs[0] if programs else None
    run.parts = parts
    run.static_floats = static
    return run


# Note [Dynamic shapes compile one program per shape]
# ``torch.compile(dynamic=True)``, or Dynamo's automatic dynamic shapes after a second
# size, gives the backend one graph with symbolic sizes: Dynamo does not trace again for
# a new size, and the backend receives the sizes as Python ints. An XLA program has static
# shapes, so the graph's jax trace and XLA compile run once per distinct set of sizes (the
# jit key holds the shapes and the ints); the graph itself is reused. Eleven batch sizes
# are one Dynamo graph (two where the first size is 1, which Dynamo specializes) and
# eleven XLA programs. Users who expect dynamic=True to mean one program are told, once
# per compiled function (the frame Dynamo captured, over its recompiles), when the second
# program of a symbolic graph is compiled: a ``DynamicShapesWarning``.
_WARNED_FRAMES: set = set()
_DYNAMIC_SHAPES = (
    'torch.compile(backend="tpu") with dynamic shapes: the graph Dynamo traced with '
    "symbolic sizes is reused, but XLA compiles one program per distinct input shape, and "
    "this call compiled another (each new batch size or sequence length is a full XLA "
    "compile). To bound compiles, pad inputs to a few fixed sizes: a tokenizer's "
    "pad_to_multiple_of=64, batches padded to a power of two, or "
    "torchjax.bucketed(fn, buckets=(...), dim=...); dynamic=True does not avoid them. "
    "Shown once per compiled function."
)


def _programs(parts) -> list:
    """The compiled programs of a graph's parts now (a part may split as it runs)."""
    return [p for part in parts for p in part.programs()]


def _has_symbolic_sizes(example_inputs) -> bool:
    """Whether Dynamo traced the graph with symbolic sizes (a SymInt input, or a tensor
    input whose shape holds one)."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in x.shape):
            return True
    return False


def _warn_per_shape(frame, parts) -> None:
    if any(p.trace_count > 1 for p in parts):
        _WARNED_FRAMES.add(frame)
        warnings.warn(_DYNAMIC_SHAPES, DynamicShapesWarning, stacklevel=4)


def _floats_stay_static(host, example_inputs) -> str | None:
    """Why a graph's floats must be static values from the start (Note [Traced Python
    floats]), or None: a traced value cannot leave its program, so a graph split around
    host copies (a host part would compute with a dead tracer) and a graph whose inputs
    require grad (autograd keeps the float for a backward traced later) take numbers."""
    if host:
        return "the graph has host parts (Note [Host copies in compiled graphs])"
    # Dynamo guards on grad mode: a graph made under no_grad only runs under it
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    ):
        return "an input requires grad: the backward would read the float"
    return None


# Trace failures that a graph of static numbers may not have: the number was read
# (NeedsValue), a lowering branched on it (a concretization error, raised as
# DataDependentError), or torch's symbolic-number code met a node kind it did not expect
# (TypeError, AttributeError, AssertionError from torch.fx.experimental). All are raised
# while tracing, before anything ran; a real error of the graph is raised again by the
# static trace.
_NEEDS_STATIC = (
    traced_scalars.NeedsValue,
    DataDependentError,
    TypeError,
    AttributeError,
    AssertionError,
)


def _item(x):
    """``.item()`` of a graph's float input (Note [Traced Python floats]): under the
    trace a SymFloat over its traced value; a number passed as a static value is itself."""
    if isinstance(x, (float, int, bool)):
        return x
    value = x._value() if isinstance(x, JaxTensor) else None
    if isinstance(value, jax.core.Tracer):
        return traced_scalars.traced(value)
    return x.item()


# Note [Python floats Dynamo passes as tensors]
# With torch's default ``specialize_float=False``, a float that changed between calls
# (a module attribute such as attention's ``scaling`` once two models share the code,
# a learning rate) comes back on the recompile as a 0-d float64 CPU tensor input whose
# only use is ``.item()`` inside the graph (or inside a checkpointed region's subgraph,
# which takes it as an operand); inductor's AOTAutograd pass rewrites those
# into tensor ops. A float input stays an input of the program and its ``.item()`` a
# traced value (Note [Traced Python floats] in torchjax/ops/traced_scalars.py): a new
# learning rate every step compiles nothing. Any other such input (an int) is handed to
# the graph as the Python number itself, a static value of the jit key (Note [Typed
# keys for static values]), and so is a float whose graph needs its number: the graph
# computes exactly what eager Python would with it, and each new value is one more
# compiled program (the jit's retrace warning says so when it repeats).
def _scalars_as_values(gm: torch.fx.GraphModule, example_inputs):
    """Positions of the 0-d CPU tensor inputs used only through ``.item()``: those the
    graph now takes as numbers, and the floats whose ``.item()`` is now ``_item``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions, floats, changed = [], [], set()
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if not (
            isinstance(example, torch.Tensor)
            and type(example) is torch.Tensor
            and example.device.type == "cpu"
            and example.dim() == 0
        ):
            continue
        items = _item_uses(gm, node)
        if not items:
            continue
        traced = example.is_floating_point()
        for owner, use in items:
            graph, value = owner.graph, use.args[0]
            if traced:
                with graph.inserting_before(use):
                    item = graph.call_function(_item, (value,))
                item.meta.update(use.meta)
                use.replace_all_uses_with(item)
            else:
                use.replace_all_uses_with(value)
            graph.erase_node(use)
            changed.add(owner)
        (floats if traced else positions).append(i)
    for owner in changed:
        owner.recompile()
    return positions, floats


# Higher-order ops that call a subgraph (their first argument) with the operands after
# it, one placeholder each: a float read inside a checkpointed region is read there.
@functools.cache
def _region_ops() -> frozenset:
    hops = torch.ops.higher_order
    return frozenset(
        getattr(hops, name) for name in ("tag_activation_checkpoint", "wrap") if hasattr(hops, name)
    )


def _item_uses(gm: torch.fx.GraphModule, node) -> list | None:
    """The ``.item()`` calls that are ``node``'s only uses, as (graph module, node),
    followed into the subgraphs of checkpointed regions; None where it has another use."""
    if not node.users:
        return None
    found = []
    for use in node.users:
        if use.op == "call_method" and use.target == "item":
            found.append((gm, use))
            continue
        inner = _region_placeholder(gm, use, node)
        more = None if inner is None else _item_uses(*inner)
        if more is None:
            return None
        found.extend(more)
    return found


def _region_placeholder(gm, use, node):
    """(subgraph, its placeholder) that ``node`` reaches as an operand of ``use``, a
    region op that takes it once; else None."""
    if use.op != "call_function" or use.target not in _region_ops() or not use.args:
        return None
    body, operands = use.args[0], use.args[1:]
    if getattr(body, "op", None) != "get_attr" or node in use.kwargs.values():
        return None
    at = [k for k, a in enumerate(operands) if a is node]
    sub = getattr(gm, body.target, None)
    if len(at) != 1 or not isinstance(sub, torch.fx.GraphModule):
        return None
    inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return (sub, inner[at[0]]) if at[0] < len(inner) else None


# Note [CPU attributes of a compiled graph]
# Dynamo hands tensors it reaches through objects (an optimizer's state, a module's
# buffers) to the backend as attributes of the graph module. jax.jit takes a CPU tensor
# there as a constant of the program, read when it is traced: non-capturable Adam's
# ``step`` (a CPU tensor, ``step_t += 1``) was then incremented once, at the trace, and
# every later step used the first step's bias correction. Each CPU attribute is made an
# input of the graph instead, read on every call, and one the graph writes is written
# back after it (Note [CPU tensors a compiled call writes] in torchjax/compile/_entry.py).
def _host_attributes_as_inputs(gm: torch.fx.GraphModule):
    """The graph with its ``get_attr`` nodes of CPU tensors made trailing placeholders
    (a copy: Dynamo reads the placeholders of its own graph afterwards), and their
    targets, in the order ``run`` appends them to the inputs."""
    from torchjax.tensor._tensor import JaxTensor

    targets = [
        n.target
        for n in gm.graph.nodes
        if n.op == "get_attr"
        and isinstance(value := operator.attrgetter(n.target)(gm), torch.Tensor)
        and not isinstance(value, JaxTensor)
    ]
    if not targets:
        return gm, []
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    placeholders: dict = {}  # target -> its new input
    for target in dict.fromkeys(targets):
        placeholders[target] = graph.placeholder(f"host_{len(placeholders)}")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in placeholders:
            env[node] = placeholders[node.target]
            env[node].meta.update(node.meta)
        elif node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    found = list(placeholders)
    return torch.fx.GraphModule(gm, graph), found


def stats() -> dict:
    """Counters over every graph compiled by the "tpu" backend in this process.

    Returns:
        ``{"graphs": graphs Dynamo captured, "traces": jax traces (one XLA compilation
        each) over all of them, "cache_hits": calls served by an existing executable}``.
        A graph is captured again when Dynamo recompiles (a guard failed); a trace
        happens for each new input signature of a graph.
    """
    return dict(_TOTALS)
