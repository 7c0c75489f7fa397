"""Finding the tpu tensors a jitted function reads and writes besides its arguments.

Note [State of a jitted function]
PyTorch code keeps its state in objects: a module's parameters and buffers, a
parameter's ``.grad``, an optimizer's ``state``, a KV cache object. jax.jit wants pure
functions, so torchjax.jit makes that state explicit: before each call it walks the
*roots* (the function's arguments, its closure cells, the globals its code names, the
``self`` of a bound method) and collects the ``Storage`` of every tpu tensor it finds.
Those storages become inputs of the compiled program; any storage the traced code writes
(``optimizer.step()``, BatchNorm's running stats, ``cache[:, pos] = k``) becomes an
output, written back after the call. Working at the storage level keeps aliasing right:
tied weights and views of one tensor are one input.

Python numbers and strings in those closures, defaults and globals are read at trace
time: they are guards (part of the cache key), so changing one retraces, as are the
plain attributes of the modules reached (Note [A module's plain attributes are guards]
in torchjax/compile/_attribute_guards.py). Optimizer
hyperparameters are inputs or guards too (Note [Hyperparameters: traced or guarded] in
torchjax/compile/_hyper.py).

Note [CPU tensors in the state]
A CPU tensor the function reaches (a counter in its closure, a CPU buffer of a module
whose layers are on tpu) cannot be an input of the program: the code runs CPU ops on
it. The trace reads it, so its value is baked into the program, and writes it at trace
time only. So each one is a guard by identity and version counter: a value changed in
place (or a new tensor) traces again instead of running with a stale constant, and a
function that writes one in place traces on every call, which repeats the write as
eager does. The first such trace warns (torchjax/compile/_jit.py): keep such state on
tpu to compile it once.

Note [Tensors kept as plain module attributes]
A tensor kept as a plain attribute of a module (``self.scale = torch.tensor(2.0)``,
transformers' ``original_inv_freq``), not registered as a buffer, is state too: eager
code sees it change (``m.scale.fill_(3)``, ``m.scale = t``). Scanning every module's
``__dict__`` on every call would cost more than a small model's forward, so it is done
when a call is about to trace: each module the walk reached is scanned once for tensor
attributes (and lists, tuples and dicts holding tensors), and the (module, name) pairs
found are remembered by the compiled function. Every later call's walk reads those
attributes (a ``getattr`` each) and adds what they hold: an in-place change is an
input's new value, a reassignment a new storage, which traces again as a new buffer
does; a write inside the function is written back. What the function itself stores in
an attribute is found after its trace (Note [Tensors a trace stores in module
attributes] in torchjax/compile/_stored.py).

What the walk cannot see even so (a tensor reachable only through a C extension, or a
global read by a callee but not named by the function itself) is read at trace time
and baked into the program as a constant, as jax.jit does with closed-over arrays. A write to such a
tensor, or a backward that would fill its ``.grad``, is refused instead (Note [Writes
that escape a trace], Note [Gradients that escape a trace]).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
import weakref

import torch

from torchjax.compile import _attribute_guards
from torchjax.compile._keys import value_key
from torchjax.tensor._tensor import JaxTensor

_MAX_DEPTH = 6
_GUARDED = (bool, int, float, complex, str)
_LEAF_TYPES = (
    type(None), bool, int, float, complex, str, bytes, type, types.ModuleType,
    types.BuiltinFunctionType, torch.dtype, torch.device, torch.Size,
)  # fmt: skip
# Note [The walk's exact-type fast path]
# ``add`` runs for every object the walk reaches (a 16-layer model's static cache: some
# 200 per call, in each of generate's programs), and an object of a leaf type or a
# JaxTensor went through up to ten ``isinstance`` checks before being placed. Tried
# first, by its exact type: ``isinstance`` answers True for an object whose type is
# the class itself before asking any ``__instancecheck__``, so the answer is the same;
# subclasses and other objects take the checks as before.
_LEAF_EXACT = frozenset(_LEAF_TYPES)


class StateWalk:
    """The storages reachable from some roots, in a deterministic order.

    ``storages``: unique Storage objects; ``tensors``: one JaxTensor per storage (the first
    found, used for error messages); ``every``: every distinct JaxTensor found (several may
    view one storage: a flat buffer's parameters) and ``grad_flags`` their
    ``requires_grad`` and leafness, part of a call's key;
    ``optimizers``: torch.optim.Optimizer objects seen; ``generators``: the
    torch.Generator objects seen (Note [CPU generators a trace moves] in
    torchjax/compile/_host_rng.py);
    ``scalars``: the Python numbers and strings in the closures, defaults and named
    globals of the functions walked (guards: read at trace time, so part of the key).
    """

    def __init__(self, grads: bool = True):
        self.grads = grads
        self.storages = []
        self.tensors = []
        self.every = []
        self.grad_flags = []
        self.optimizers = []
        self.generators = []
        self.modules = []
        self.configs = []  # Note [A module's config is a guard]
        # Note [A module's plain attributes are guards] (_attribute_guards.py)
        self.attribute_tokens = []
        self.module_refs = []  # Note [A module's config is a guard]
        self.scalars = []
        self.host = []
        self._seen_storage = set()
        self._seen_tensor = set()
        self._seen_obj = set()

    def add_tensor(self, t) -> None:
        if t is None:
            return
        if isinstance(t, JaxTensor):
            s = t._storage
            if id(s) not in self._seen_storage:
                self._seen_storage.add(id(s))
                self.storages.append(s)
                self.tensors.append(t)
            if id(t) not in self._seen_tensor:
                self._seen_tensor.add(id(t))
                self.every.append(t)
                self.grad_flags.append(t.requires_grad and (2 if t.grad_fn is None else 1))
            leaf = self.grads and t.requires_grad and t.is_leaf
            grad = t.grad if leaf else None
            if grad is not None:
                self.add_tensor(grad)
            if leaf:
                self._add_hooks(t)
        elif isinstance(t, torch.Tensor) and id(t) not in self._seen_tensor:
            self._seen_tensor.add(id(t))
            self.host.append(t)

    def _add_hooks(self, t) -> None:
        # A leaf's gradient hooks run inside the function's backward: an optimizer
        # stepped from a post-accumulate-grad hook (optimizer in backward), and what else
        # they close over, is state as if the function named it. Unseen, the step's
        # state was made in every trace and left holding tracers.
        for hooks in (t._backward_hooks, t._post_accumulate_grad_hooks):
            for hook in (hooks or {}).values():
                self.add(hook)  # as a root: a wrapper may hold the user's function

    def host_versions(self) -> tuple:
        """Each CPU tensor of the state by identity and version counter (Note [CPU
        tensors in the state])."""
        # Inference tensors keep no version counter: identity alone.
        return tuple((id(t), None if t.is_inference() else t._version) for t in self.host)

    def add_module(self, m: torch.nn.Module) -> None:
        # Registered parameters and buffers only (what state_dict() and .to() see): the
        # walk runs on every call, and scanning each module's __dict__ would cost more
        # than a small model's forward. A tensor kept as a plain attribute is read at
        # trace time and becomes a constant of the program.
        shared = _SHARED.get()
        if shared is None or self.grads:
            self._add_module(m)
            return
        # Note [A module walked once within a block]
        found = shared.get(id(m))
        if found is None or not found.holds(m, self):
            found = _Found.of(m)
            if not found.apart_from(self):
                self._add_module(m)
                return
            shared[id(m)] = found
        found.add_to(self)

    def _add_module(self, m: torch.nn.Module) -> None:
        stack = [m]
        seen = self._seen_obj
        modules = self.modules
        guarded = _attribute_guards.SEEN
        refs, tokens = self.module_refs, self.attribute_tokens
        while stack:
            mod = stack.pop()
            if mod is None or (at := id(mod)) in seen:
                continue
            seen.add(at)
            modules.append(mod)
            d = mod.__dict__
            config = d.get("config")
            if config is not None and id(config) not in seen:
                seen.add(id(config))
                self.configs.append(config)
            # Note [A module's plain attributes are guards]: the fast path of
            # _attribute_guards.key, inline (this loop runs for every module on every
            # call), which finds the module's weak reference too.
            g = guarded.get(at)
            try:
                if g is None or g.size != len(d) or g.get(d) != g.vals:
                    g = _attribute_guards.seen(mod)
            except _attribute_guards.COMPARE_ERRORS:  # an attribute deleted or retyped
                g = _attribute_guards.seen(mod)
            refs.append(g.ref)
            tokens.append(g.token)
            for p in d["_parameters"].values():
                if p is not None:
                    self.add_tensor(p)
            for b in d["_buffers"].values():
                if b is not None:
                    self.add_tensor(b)
            stack.extend(reversed(d["_modules"].values()))

    def add_attributes(self, attributes) -> None:
        """What the remembered plain attributes hold now (Note [Tensors kept as plain
        module attributes]); ``attributes``: a compiled function's, (weak reference to a
        module, name) pairs by (id(module), name)."""
        for ref, name in attributes.values():
            mod = ref()
            if mod is not None:
                self.add(mod.__dict__.get(name))

    def config_key(self) -> tuple:
        """The plain values of every module's ``config`` (Note [A module's config is a
        guard])."""
        return tuple(_plain_values(c) for c in self.configs)

    def module_key(self) -> tuple:
        """Each module reached, by identity (Note [A module's config is a guard]): a
        submodule swapped for another traces again. Weak references: equal while both
        modules live and are the same object, so a new module at a freed one's address
        (its ``id``) is not the old one; the key keeps no module alive."""
        return tuple(self.module_refs)

    def attribute_key(self) -> tuple:
        """The plain attributes of every module reached (Note [A module's plain
        attributes are guards] in torchjax/compile/_attribute_guards.py)."""
        return tuple(self.attribute_tokens)

    def attribute_key_now(self) -> tuple:
        """``attribute_key`` read again, after a trace that may have changed them."""
        return _attribute_guards.key(self.modules)

    def training_flags(self) -> tuple[bool, ...]:
        """``module.training`` of every module seen: tracing depends on them."""
        return tuple(m.training for m in self.modules)

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.optimizers.append(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                self.add_tensor(p)
            for v in group.values():
                if isinstance(v, JaxTensor):
                    self.add_tensor(v)
        for st in opt.state.values():
            for v in st.values():
                self.add_tensor(v)

    def add(self, obj, depth: int = 0) -> None:
        """Walk ``obj``: tensors, modules, optimizers, containers and plain objects."""
        t = type(obj)  # Note [The walk's exact-type fast path]
        if t in _LEAF_EXACT or depth > _MAX_DEPTH:
            return
        if t is JaxTensor:
            self.add_tensor(obj)
            return
        if isinstance(obj, _LEAF_TYPES):
            return
        if isinstance(obj, torch.Tensor):
            self.add_tensor(obj)
            return
        if id(obj) in self._seen_obj:
            return
        if isinstance(obj, torch.nn.Module):
            self.add_module(obj)
            return
        self._seen_obj.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            self.add_optimizer(obj)
        elif isinstance(obj, torch.Generator):
            self.generators.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                self.add(v, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                self.add(v, depth + 1)
        elif isinstance(obj, types.MethodType):
            self.add(obj.__self__, depth + 1)
            self.add_function(obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            if depth <= 2:  # helpers the function calls; not whole libraries
                self.add_function(obj, depth + 1)
        elif isinstance(obj, functools.partial):
            # Its function and bound arguments are slots, not in its __dict__.
            self.add(obj.func, depth + 1)
            for v in (*obj.args, *obj.keywords.values()):
                self._add_value(v, depth + 1)
        elif hasattr(obj, "__dict__"):
            # Plain objects (an HF cache, a config holding tensors).
            for v in vars(obj).values():
                self.add(v, depth + 1)

    def add_function(self, fn: types.FunctionType, depth: int = 0) -> None:
        """A function's closure cells, defaults and the globals its code (and the code of
        functions defined inside it) names."""
        for cell in fn.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self._add_value(v, depth + 1)
        for d in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            self._add_value(d, depth + 1)
        g = fn.__globals__
        for name in _global_names(fn.__code__):
            if name in g:
                self._add_value(g[name], depth + 1)

    def _add_value(self, v, depth: int) -> None:
        # A number the code reads is baked into the trace: guard it (a changed value
        # retraces) rather than keep a stale constant.
        if type(v) in _GUARDED:
            self.scalars.append(value_key(v))
        else:
            self.add(v, depth)


# Note [A module's config is a guard]
# A model's forward reads its configuration in Python at trace time: transformers
# dispatches attention and MoE experts by ``config._attn_implementation`` and
# ``config._experts_implementation`` (``set_attn_implementation``,
# ``set_experts_implementation``), and reads flags such as ``use_cache`` or
# ``output_router_logits`` from it. Changed after a call, a program keyed without them
# would run the old code: a silent wrong result, in an automatically compiled
# ``generate`` too. Dynamo guards on the attributes a graph reads; here the plain values
# (numbers, strings, None, dtypes, and lists, tuples and dicts of them) of the object
# each module holds as ``config`` are part of a call's key, so a change traces again. A
# composite model's text and vision configs are the ``config`` of the modules that read
# them. One dict lookup per module finds the configs (shared objects are read once), and
# a config's values are read on every call (about 40 for a transformers config, some
# 10-20 us). A module's other plain attributes (``Dropout.p``, a norm's ``eps``) are
# guards too, read with one getter per module (Note [A module's plain attributes are
# guards] in torchjax/compile/_attribute_guards.py). The modules themselves are guarded
# the same way, by
# identity, as Dynamo guards a module it inlines: ``model[1] = nn.Identity()`` swaps a
# submodule that brings no parameter (no state of the call changes), and the program
# traced with the old one ran on. They are keyed by weak reference, not ``id``: a loop
# that rebuilds an activation (``model[1] = nn.LeakyReLU(s)``) gets new modules at
# freed addresses, and one keyed by ``id`` found the program of an earlier slope.

_PLAIN = frozenset({type(None), bool, int, float, complex, str, torch.dtype})


def _plain_values(obj) -> tuple:
    out = []
    for name, v in vars(obj).items():
        t = type(v)
        if t in _PLAIN:
            out.append((name, value_key(v)))
        elif t in (list, tuple, dict):
            try:
                key = value_key(v)
                hash(key)
            except TypeError:  # holds something unhashable: not a plain setting
                continue
            out.append((name, key))
    return tuple(out)


def _global_names(code) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names


# Note [A module walked once within a block]
# A compiled ``generate`` makes three calls whose walks reach the same model (the
# prefill, the first token's program, the decode loop), one after another, with no code
# between them that could change the model's parameters, buffers, submodules, configs or
# plain attributes: torchjax's own glue and transformers' bookkeeping, and no forward
# hook. Walking the model once for the prefill and again for the loop cost some 0.3 ms
# of host time per walk on CPU for a 16-layer model (the model's 215 modules and 149
# tensors; about twice that within a whole generate, its caches cold). Within
# ``shared_walks()``, a walk (without gradients: a module's forward) takes what an
# earlier walk in the block found under the same module, as long as no compiled
# function's Python ran since (a trace or an eager run, which may change the modules:
# ``python_ran``, counted process-wide). The caller vouches for the rest: nothing else
# changes the modules within the block. What a walk finds under a module is found by a
# walk of that module alone and taken whole; a walk that had reached one of its
# modules, configs or tensors before (so would skip them) walks the module itself, as
# it would have without the block.
_SHARED = contextvars.ContextVar("torchjax_shared_walks", default=None)
_PYTHON_RAN = [0]


def python_ran() -> None:
    """A compiled function's Python runs (traced, or run eagerly): what walks found under
    its modules may be out of date (Note [A module walked once within a block])."""
    _PYTHON_RAN[0] += 1


@contextlib.contextmanager
def shared_walks():
    """Within the block, walks share what they find under a module (Note [A module walked
    once within a block]); the caller vouches that only torchjax's compiled calls run
    code that could change the modules in the block."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


class _Found:
    """What a walk without gradients finds under one module, and the ids it marked seen."""

    __slots__ = ("module", "ran", "walk")

    @classmethod
    def of(cls, m) -> _Found:
        self = cls()
        self.module = weakref.ref(m)
        self.ran = _PYTHON_RAN[0]
        self.walk = StateWalk(grads=False)
        self.walk._add_module(m)
        return self

    def holds(self, m, w: StateWalk) -> bool:
        """Whether this is still what a walk of ``m`` would find, and adds to ``w`` as is."""
        return self.module() is m and self.ran == _PYTHON_RAN[0] and self.apart_from(w)

    def apart_from(self, w: StateWalk) -> bool:
        """Whether ``w`` has reached none of the modules, configs and tensors found here:
        then its walk of the module finds just these (its own checks of what it saw
        never fire)."""
        f = self.walk
        return (
            w._seen_obj.isdisjoint(f._seen_obj)
            and w._seen_storage.isdisjoint(f._seen_storage)
            and w._seen_tensor.isdisjoint(f._seen_tensor)
        )

    def add_to(self, w: StateWalk) -> None:
        f = self.walk
        for name in _FOUND_LISTS:
            getattr(w, name).extend(getattr(f, name))
        w._seen_obj.update(f._seen_obj)
        w._seen_storage.update(f._seen_storage)
        w._seen_tensor.update(f._seen_tensor)


# What a module's walk (without gradients) appends to.
_FOUND_LISTS = (
    "storages", "tensors", "every", "grad_flags", "modules", "configs", "attribute_tokens",
    "module_refs", "host",
)  # fmt: skip


def walk(roots, grads: bool = True) -> StateWalk:
    """The state reachable from ``roots``; ``grads``: include parameters' ``.grad`` (a
    module's forward never touches them; a train step does)."""
    w = StateWalk(grads)
    for r in roots:
        w.add(r)
    return w


# A module's own registries: what they hold the walk's ``add_module`` already adds.
REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})


def plain_attributes(modules) -> list[tuple]:
    """(module, name) of each plain attribute of ``modules`` holding a tensor, or a
    list, tuple or dict with one (Note [Tensors kept as plain module attributes])."""
    found = []
    for mod in modules:
        for name, v in vars(mod).items():
            if name in REGISTRIES:
                continue
            if isinstance(v, torch.Tensor) or (
                isinstance(v, (list, tuple, dict))
                and any(
                    isinstance(x, torch.Tensor) for x in (v.values() if isinstance(v, dict) else v)
                )
            ):
                found.append((mod, name))
    return found
