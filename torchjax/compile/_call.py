"""One call of a torchjax.jit function: its arguments split into tensors and static
values, the state it reaches, and the cache key they make (steps 1-3 of torchjax.jit's
call, torchjax/compile/_jit.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import pytree
from torchjax.compile import _aliases, _attribute_guards, _hyper, _state
from torchjax.compile._capturable import make_capturable
from torchjax.compile._keys import Keyed, first_difference, value_key
from torchjax.tensor._tensor import JaxTensor, wrap

_SCALARS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


class _Flat:
    """The argument structure of a call with positional tensors/scalars only: cheaper to
    build, hash and compare than a pytree TreeSpec (this is the common case)."""

    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return type(other) is _Flat and other.n == self.n

    def __hash__(self):
        return self.n


def flatten_args(args, kwargs):
    if not kwargs and all(isinstance(a, (torch.Tensor, *_SCALARS)) for a in args):
        return list(args), _Flat(len(args))
    return pytree.tree_flatten((args, kwargs))


def unflatten_args(flat, spec):
    if type(spec) is _Flat:
        return tuple(flat), {}
    return pytree.tree_unflatten(flat, spec)


def _aval(a):
    return (a.shape, a.dtype)


class Call:
    """One call's arguments, state and cache key."""

    def __init__(self, jitted, flat, spec, static_kwargs, tree=None):
        self.jitted = jitted
        self.spec = spec
        # The caller's (args, kwargs) and, once listed, their lists and dicts (Note
        # [Containers a compiled function changes] in torchjax/compile/_containers.py).
        self.tree = tree
        self.containers = None
        self.static_kwargs = static_kwargs
        roots = [jitted.fn]
        static, pos, tensors = [], [], []
        self.host = {}  # Note [CPU tensors a compiled call writes]
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if not isinstance(x, JaxTensor):
                    self.host[len(tensors)] = x
                    x = x.to("tpu")
                pos.append(i)
                tensors.append(x)
                static.append(None)
            elif isinstance(x, _SCALARS):
                static.append(x)
            else:
                roots.append(x)
                static.append(x if _hashable_by_value(x) else Ref(x))
        roots.extend(static_kwargs.values())
        grads = not jitted._is_module
        if grads:  # Note [Gradients of arguments]: an argument's existing .grad is state
            roots.extend(
                t.grad for t in tensors if t.requires_grad and t.is_leaf and t.grad is not None
            )
        self.roots = roots
        self.static, self.pos, self.tensors = static, pos, tensors
        walk = _state.walk(roots, grads)
        if any([make_capturable(o) for o in walk.optimizers]):  # every one, no short cut
            walk = _state.walk(roots, grads)
        walk.add_attributes(jitted.attributes)
        self.walk = walk
        self.hypers = _hyper.Hypers(walk.optimizers)
        self.storages = walk.storages
        self.state_arrays = [s.arr for s in walk.storages]
        self.arrays = [t._value() for t in tensors]
        self.bits = tuple(_math_bits(t) for t in tensors)
        grad_mode = torch.is_grad_enabled()
        flags = (grad_mode, *global_modes(), walk.training_flags(), walk.config_key())
        flags += (walk.module_key(), walk.attribute_key())
        self.sig = (
            spec,
            tuple(value_key(v) for v in static),
            tuple(_static_key(v) for v in static_kwargs.items()),
            tuple(_aval(a) for a in self.arrays),
            tuple((t.requires_grad, t.requires_grad and t.is_leaf) for t in tensors),
            tuple(map(id, self.storages)),
            tuple(_aval(a) for a in self.state_arrays),
            flags,
            (self.hypers.key, tuple(walk.scalars), tuple(_aval(a) for a in self.hypers.values)),
            tuple(type(t) for t in tensors),
            self.bits,
            tuple(walk.grad_flags),
            walk.host_versions(),  # Note [CPU tensors in the state]
            _aliases.sharing(tensors, self.storages),
        )
        self.key = self.sig
        self.grad_mode = grad_mode
        # Set by the program's write-back (Note [State after a trace whose program does
        # not run] in torchjax/compile/_rollback.py).
        self.written_back = False

    def key_after_trace(self) -> None:
        """Key this call by its modules' plain attributes as the trace left them (Note
        [A module's plain attributes are guards] in torchjax/compile/_attribute_guards.py)."""
        flags = self.sig[_FLAGS]
        attributes = self.walk.attribute_key_now()
        if attributes != flags[-1]:
            self.sig = (*self.sig[:_FLAGS], (*flags[:-1], attributes), *self.sig[_FLAGS + 1 :])
            self.key = self.sig


_FLAGS = 7  # where a call's mode flags are in its key


def global_modes() -> tuple:
    """torch's process-wide settings a trace reads and bakes into its program: autocast
    (on, and its dtype), the default dtype of new tensors, and the float32 matmul
    precision (Note [Matmul precision] in torchjax/ops/matmul.py). A change retraces, as
    Dynamo's global-state guard does; a program traced under bfloat16 autocast returned
    bfloat16 inside a float16 region."""
    autocast = torch.is_autocast_enabled("tpu")
    return (
        autocast,
        torch.get_autocast_dtype("tpu") if autocast else None,
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
    )


# Note [Arguments with conj or neg bits]
# A call passes each tensor argument's values (``_value()``: a conj tensor's resolved
# values). Traced as a plain tensor of those values, ``z.conj()`` of a conj argument
# would look like a new conj view where eager gives the plain tensor under the bit, and
# ``z.resolve_conj()`` would be the argument itself where eager makes a new tensor: the
# outputs rebuilt as views of the argument (Note [Aliased outputs of a compiled
# function]) would get the wrong bits, and the wrong values. So the bits are part of
# the key, and the trace gives such an argument the bits it has: a tensor over the
# values' stored form (conjugated, negated) viewed back with ``_conj`` / ``_neg_view``,
# as the argument is in eager. Its root storage holds the stored form, so a write to it
# is detected there.
def _math_bits(t) -> tuple:
    return (t.is_conj(), t.is_neg()) if t.is_conj() or t.is_neg() else ()


def traced_argument(arr, device_index: int, bits: tuple):
    """The tpu tensor a trace sees for an argument with values ``arr`` (a tracer) and
    math ``bits`` (Note [Arguments with conj or neg bits])."""
    if not bits:
        return wrap(arr, device_index)
    conj, neg = bits
    stored = jnp.conj(arr) if conj else arr
    t = wrap(-stored if neg else stored, device_index)
    if conj:
        t = t._conj()
    return t._neg_view() if neg else t


def _static_key(item):
    k, v = item
    try:
        hash(v)
    except TypeError:
        raise TypeError(
            f"torchjax.jit: static argument {k!r} must be hashable, got {type(v).__name__}"
        ) from None
    return (k, value_key(v))


def _hashable_by_value(x) -> bool:
    """Enums, frozen dataclasses, slices...: equal values share an executable. Modules,
    optimizers and objects without a value hash are keyed by identity (Ref)."""
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return False
    if type(x).__hash__ in (None, object.__hash__):
        return False
    try:
        hash(x)
    except TypeError:
        return False
    return True


class Ref:
    """A non-scalar argument (module, optimizer, cache object): keyed by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, Ref) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)

    def __repr__(self):
        return f"<{type(self.obj).__name__} object>"


# The parts of a call's mode flags (``flags`` in ``Call``), named in a retrace reason.
_MODES = ("grad mode", "autocast", "autocast dtype", "default dtype",
          "float32 matmul precision", "module training flags", "modules' config values",
          "submodules (one swapped for another)", "module attributes")  # fmt: skip


def describe_change(old, new) -> str:
    names = ("argument structure", "non-tensor arguments", "static_argnames values",
             "tensor argument shapes/dtypes", "tensor argument requires_grad",
             "state tensors (identity)", "state tensor shapes/dtypes",
             "grad mode / autocast and its dtype / default dtype / float32 matmul "
             "precision / module training flags / a module's config values / the "
             "submodules (one swapped for another) / a module's plain attributes",
             "Python scalars read by the function (optimizer hyperparameters other than "
             "lr, numbers in its closure or globals)",
             "tensor argument classes (torch.Tensor subclasses)",
             "tensor argument conj / neg bits",
             "state tensors' requires_grad",
             "CPU tensors in the state (a new tensor, or a value written in place)",
             "tensor arguments sharing memory with each other or with state")  # fmt: skip
    for name, a, b in zip(names, old, new):
        if a != b and name.startswith("grad mode") and len(a) == len(b) == len(_MODES):
            changed = [n for n, x, y in zip(_MODES, a, b) if x != y]
            if changed == ["module attributes"]:  # which one, where the modules are the same
                said = _attribute_guards.describe(a[-1], b[-1], a[-2])
                if said is not None:
                    return said
            return "the " + " and ".join(changed) + " changed"
        if a != b:
            if name == "tensor argument shapes/dtypes" and len(a) == len(b):
                for k, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        return f"tensor argument #{k} changed from {_fmt(x)} to {_fmt(y)}"
            if name == "non-tensor arguments" and len(a) == len(b):
                for x, y in zip(a, b):
                    if x != y:
                        if type(x) is Keyed and type(y) is Keyed:  # the item that changed
                            x, y = first_difference(x.value, y.value)
                        return f"a non-tensor argument changed from {x!r} to {y!r}"
            if name.startswith("state tensors"):
                return (
                    f"the {name} changed ({len(a)} -> {len(b)} tensors; e.g. optimizer "
                    "state created, or a tensor attribute reassigned)"
                )
            return f"the {name} changed"
    return "the cached executable's state tensors were freed"


def _fmt(aval) -> str:
    shape, dtype = aval
    return f"{np.dtype(dtype).name}{list(shape)}"
