"""A JAX function (a Pallas kernel, or any jax code) as a PyTorch operator.

``@torchjax.pallas.op("mylib::myop")`` defines ``torch.ops.mylib.myop`` with
``torch.library``: a schema (inferred from the function's signature), a fake
implementation (``jax.eval_shape`` of the function, or one the user gives), the tpu
implementation, and autograd (the function's VJP, so a ``jax.custom_vjp`` backward is
used when the function has one).

Note [How a kernel op reaches jax]
A tpu tensor is a wrapper subclass: the Python dispatch key sits above PrivateUse1, so
every op on it, ``mylib::myop`` included, arrives in ``JaxTensor.__torch_dispatch__`` and
from there in the op registry (torchjax/ops/registry.py). The tpu implementation is
therefore a registry handler, not a ``PrivateUse1`` kernel, which runs the function as
the op's lowering (Note [A kernel op is an eager op]). Under ``torchjax.jit`` the
tensors hold tracers and the function is inlined into the outer trace. Under
``torch.compile(backend="tpu")`` Dynamo traces with fake tensors, which reach the fake
implementation; the captured FX graph calls ``torch.ops.mylib.myop`` on real (traced)
tpu tensors, i.e. the same handler.

Note [A kernel op is an eager op]
A call that keeps no pullback (Note [Kernel op backward]) runs through the registry's
compiled path with the function as the op's lowering (``functional_handler``, Note
[Compiled lowerings] in torchjax/ops/cached_compute.py): one cached executable per
static arguments and input signature, built with eager's ``COMPILER_OPTIONS``, a view
argument read inside it. So fused eager mode records the op as it records an ATen op
(Note [Fused eager] in torchjax/ops/fused.py), and a captured module call traces it as
a node of its program (Note [Captured module calls] in torchjax/compile/_captured.py),
behind the conditional that keeps any op that is not elementwise as its own executable
computes it: eager's bits. Called through ``torchjax.jax_function`` (a ``jax.jit`` of
its own), the op did neither: reading its inputs' arrays ran the recorded segment
first, so every attention layer on TPU (the flash kernel in a prefill, the exact op or
the decode kernel in a decode step) ended a segment, a 16-layer Llama forward running
17 segments; and a captured call's trace held the function inline, outside every node
(a ``custom_vjp_call`` computing floats), and was refused: on the chip no Llama call
was captured.

Note [Kernel op backward]
Autograd is registered with ``torch.library.register_autograd``. A call through the
:class:`KernelOp` in eager mode, with grad enabled and a floating input requiring grad,
marks the op (a context variable) for its tpu implementation, which then runs
``jax.vjp`` of the function under ``jax.jit`` instead of the plain call: one compiled
forward that returns the outputs and the pullback (a ``jax.tree_util.Partial`` holding
the residuals: flash attention's log-sum-exp, a custom_vjp's saved values). The pullback
rides on the first output to ``setup_context``, which moves it into the autograd
context, and ``backward`` applies it (one compiled call): the forward is not run again.
The residuals live as long as the autograd graph (saved tensors are freed when a
``backward()`` without ``retain_graph`` ends; these are not, since the backward cannot
see that flag), so a second ``backward()`` through the op works. The mark is needed
because below the Autograd key the implementation cannot tell autograd's call (grad
disabled inside the ``autograd.Function``) from a ``torch.no_grad()`` call on
parameters that require grad, where keeping residuals would only cost memory.
Where no pullback is kept (``torch.ops.mylib.myop`` called directly; inputs are
tracers: under ``torchjax.jit``, ``torch.compile`` and in a captured module call; fake
tensors in Dynamo's pass) the backward is a second op, ``mylib::myop_backward``, whose
tpu implementation is ``jax.vjp`` of the function at the saved inputs applied to the
output cotangents: it recomputes the forward, which keeps the op's schema that of the
user's function. It runs as the forward does (Note [A kernel op is an eager op]):
through the registry's compiled path, so fused eager mode records it and a captured
call's backward traces it as a node. Run through ``torchjax.jax_function`` (a
``jax.jit`` of its own) it was inlined outside every node, so a captured call whose
backward held it (a train step whose SDPA took the flash kernel or the exact op, as on
TPU) was refused and ran op by op (Note [Captured calls that need a graph] in
torchjax/compile/_captured.py). The kernel is deterministic, so the recomputed forward
gives the kept pullback's residuals: a tiny Llama's captured AdamW steps equal fused
eager's op by op steps (which keep the pullback) bit for bit
(tests/compile/test_captured_kernels.py), for one more run of the forward kernel per
call in the backward program.

Note [Complex cotangents]
torch and JAX pull gradients back through complex values by conjugate conventions: for a
VJP, torch's ``grad_input = conj(jax_vjp(conj(grad_output)))``. Every backward path of
a kernel op and of ``jax_function`` applies the pullback through one function doing that
(``conj_vjp``, a no-op for real dtypes), so a complex input's ``.grad`` equals CPU's.

The JAX mode an op runs its function in (32-bit unless registered with ``x64=True``) is
Note [A kernel op's JAX mode] in torchjax/pallas/_jax_mode.py.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import x64
from torchjax._compat.torch import FunctionSchema, pytree
from torchjax.interop._convert import to_jax
from torchjax.interop._jax_function import conj_vjp
from torchjax.ops.registry import functional_handler, handler
from torchjax.pallas._jax_mode import in_32bit_mode
from torchjax.pallas._no_derivative import no_derivative, no_derivative_error
from torchjax.tensor._tensor import wrap
from torchjax.tensor.dtypes import to_jax_dtype, to_torch_dtype

_SCALAR_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def interpret_default() -> bool:
    """``True`` where Pallas kernels must run in interpret mode: jax's default backend
    is neither TPU nor GPU (Pallas compiles for those two only)."""
    return jax.default_backend() not in ("tpu", "gpu", "cuda", "rocm")


def op(
    name: str,
    *,
    schema: str | None = None,
    outputs: int = 1,
    fake: Callable | None = None,
    differentiable: bool = True,
    x64: bool = False,
):
    """Decorator: register the JAX function ``fn`` as the PyTorch operator ``name``.

    Args:
        name: ``"namespace::opname"``; a bare ``"opname"`` goes to the ``torchjax``
            namespace. The op is then ``torch.ops.<namespace>.<opname>``.
        schema: the torch schema without the name, e.g. ``"(Tensor x, float s) -> Tensor"``.
            Default: inferred from ``fn``'s signature: parameters without default are
            ``Tensor``; defaults ``None`` make ``Tensor?``; bool/int/float/str defaults
            make scalar arguments of that type (static: one compiled executable per value).
            Parameter names must match ``fn``'s (arguments are passed by name).
        outputs: number of tensor outputs of ``fn`` (a tuple when > 1), for the
            inferred schema.
        fake: ``fake(*args, **kwargs)`` returning the output ``torch.Tensor``(s) (e.g.
            ``x.new_empty(shape)``) from fake inputs, for FakeTensor and
            ``torch.compile``. Default: ``jax.eval_shape`` of ``fn`` at the inputs'
            shapes and dtypes (sizes must be concrete; symbolic sizes are specialised).
        differentiable: register autograd (Note [Kernel op backward]); float outputs
            then carry a ``grad_fn`` and integer inputs get no gradient.
        x64: trace ``fn`` with JAX's 64-bit types, as torchjax's own ops run. Default
            False: ``fn`` runs in JAX's default 32-bit mode, the mode Pallas kernels are
            written for (Mosaic has no 64-bit integers), forward and backward alike; an
            int64 argument arrives as int32 (values past 2**31 raise at the next sync),
            a float64/complex128 one is refused with a TypeError: cast it (``.float()``)
            or pass ``x64=True`` (Note [A kernel op's JAX mode]).

    Returns:
        A decorator returning a :class:`KernelOp`: callable like ``fn`` on tpu tensors
        (``torch.ops`` call), with ``.op`` the ``OpOverload`` and ``.fn`` the jax function.
        Its tensors must all be on one tpu device: a CPU tensor beside tpu ones is
        refused (RuntimeError "Expected all tensors to be on the same device", as
        torch's ops refuse mixed devices), not copied to tpu on every call.

    Raises:
        ValueError: ``schema`` cannot be inferred (a default of unsupported type).
        RuntimeError: the op name is already defined (torch.library's error).
    """

    def deco(fn):
        return KernelOp(name, fn, schema, outputs, fake, differentiable, x64)

    return deco


@dataclasses.dataclass
class _Param:
    name: str
    kind: str  # "Tensor", "Tensor?", or a scalar type name


def _infer_params(fn) -> list[_Param]:
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(
                f"torchjax.pallas.op: cannot infer a schema for {fn.__name__} with "
                f"*{p.name}; give schema= explicitly"
            )
        if p.default is p.empty:
            params.append(_Param(p.name, "Tensor"))
        elif p.default is None:
            params.append(_Param(p.name, "Tensor?"))
        elif type(p.default) in _SCALAR_TYPES:
            params.append(_Param(p.name, _SCALAR_TYPES[type(p.default)]))
        else:
            raise ValueError(
                f"torchjax.pallas.op: parameter {p.name!r} of {fn.__name__} has a default of "
                f"type {type(p.default).__name__}; expected None, bool, int, float or str "
                "(or give schema= explicitly)"
            )
    return params


def _schema_from(fn, outputs: int) -> str:
    sig = inspect.signature(fn)
    parts = []
    for p, param in zip(_infer_params(fn), sig.parameters.values()):
        if param.default is param.empty:
            parts.append(f"{p.kind} {p.name}")
        else:
            parts.append(f"{p.kind} {p.name}={param.default!r}")
    ret = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    return "(" + ", ".join(parts) + ") -> " + ret


def _tensor_arg_names(schema: FunctionSchema) -> list[str]:
    # ``Tensor`` and ``Tensor?`` (which prints as ``Optional[Tensor]``): an optional mask
    # passed as a static argument reached jax.jit as a torch tensor.
    return [a.name for a in schema.arguments if str(a.type) in ("Tensor", "Optional[Tensor]")]


def _to_struct(x):
    if isinstance(x, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(int(s) for s in x.shape), to_jax_dtype(x.dtype))
    return x


# 64-bit floats a 32-bit function would round: refused (Note [A kernel op's JAX mode] in
# torchjax/pallas/_jax_mode.py).
_WIDE_FLOATS = {torch.float64: "torch.float32", torch.complex128: "torch.complex64"}


def _differentiable(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.dtype.is_floating_point or t.dtype.is_complex)
    )


# Applies a kept pullback (Note [Kernel op backward]); the Partial's function is part of
# its pytree structure, so one executable per kernel op and signature.
_PULL = jax.jit(conj_vjp)
_VJP_ATTR = "_torchjax_kernel_vjp"
_KEEP_VJP: contextvars.ContextVar = contextvars.ContextVar("torchjax_keep_vjp", default=None)


def _bind_backward(names, args, kwargs):
    """``(inputs by name, grads)`` from a ``*_backward`` call (grads come last)."""
    bound = dict(zip(names + ["grads"], args), **kwargs)
    return bound, bound.pop("grads")


class KernelOp:
    """A registered kernel op (see :func:`op`). Call it like the jax function, with
    torch tensors."""

    def __init__(self, name, fn, schema, outputs, fake, differentiable, x64=False):
        ns, _, opname = name.rpartition("::")
        ns = ns or "torchjax"
        self.x64 = x64
        # What every path runs: fn itself, or fn in 32-bit mode (Note [A kernel op's JAX
        # mode]); ``self.fn`` stays the user's function.
        self._fn = fn if x64 else in_32bit_mode(fn, f"{ns}::{opname}")
        self.fn = fn
        self.qualname = f"{ns}::{opname}"
        self._lib = torch.library.Library(ns, "FRAGMENT")
        self._lib.define(opname + (schema or _schema_from(fn, outputs)))
        self.op = getattr(getattr(torch.ops, ns), opname).default
        self._names = [a.name for a in self.op._schema.arguments]
        self._tensors = _tensor_arg_names(self.op._schema)
        self._multi = len(self.op._schema.returns) > 1
        # Calls without a kept pullback run as the eager engine's ops run (Note [A
        # kernel op is an eager op]).
        self._compute = functional_handler(self.op, self._fn)
        self._vjp_calls: dict = {}
        torch.library.register_fake(self.qualname, fake or self._eval_shape_fake, lib=self._lib)
        handler(self.op)(self._tpu)
        self.backward_op = None
        if differentiable:
            self._define_backward(ns, opname)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        if self.backward_op is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return self.op(*args, **kwargs)
        token = _KEEP_VJP.set(self)  # Note [Kernel op backward]
        try:
            return self.op(*args, **kwargs)
        finally:
            _KEEP_VJP.reset(token)

    # -- tpu implementation (Note [How a kernel op reaches jax]) ------------------------

    def _tpu(self, args, kwargs):
        self._same_device(args, kwargs)
        self._no_wide_inputs(args, kwargs)
        if _KEEP_VJP.get() is self:
            out = self._forward_keeping_vjp(args, kwargs)
            if out is not None:
                return out
        out = self._compute(args, kwargs)
        return tuple(out) if self._multi else out

    def _same_device(self, args, kwargs):
        # A kernel op runs on tpu: a CPU tensor beside tpu ones is refused, as torch's
        # ops refuse mixed devices (moving it silently would hide a host copy per call).
        bound = dict(zip(self._names, args), **kwargs)
        tensors = {n: t for n, t in bound.items() if isinstance(t, torch.Tensor)}
        devices = {t.device for t in tensors.values()}
        if len(devices) < 2:
            return
        tpu = next(d for d in devices if d.type == "tpu")
        name, t = next((n, t) for n, t in tensors.items() if t.device != tpu)
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{tpu} and {t.device}! (argument {name!r} of {self.qualname} is a "
            f"{tuple(t.shape)} {t.dtype} tensor on {t.device}; move it with .to('{tpu}'))"
        )

    def _no_wide_inputs(self, args, kwargs):
        # Note [A kernel op's JAX mode]: 32-bit mode would round a 64-bit float.
        if self.x64:
            return
        bound = dict(zip(self._names, args), **kwargs)
        for name, t in bound.items():
            if type(t) is int and not -(2**31) <= t < 2**31:
                raise TypeError(
                    f"{self.qualname}: argument {name!r} is {t}, past the int32 range of "
                    "JAX's default 32-bit mode, which the op runs its JAX function in; "
                    "register the op with torchjax.pallas.op(..., x64=True) to trace it "
                    "with 64-bit types"
                )
            listed = isinstance(t, (list, tuple))
            for i, x in enumerate(t if listed else [t]):  # a Tensor[] argument's too
                if isinstance(x, torch.Tensor) and x.dtype in _WIDE_FLOATS:
                    narrow = _WIDE_FLOATS[x.dtype]
                    arg = f"{name}[{i}]" if listed else name
                    raise TypeError(
                        f"{self.qualname}: argument {arg!r} is a {tuple(x.shape)} {x.dtype} "
                        f"tensor, but the op runs its JAX function in JAX's default 32-bit "
                        f"mode, which would round it to {narrow}; pass {arg}.to({narrow}), or "
                        f"register the op with torchjax.pallas.op(..., x64=True) to trace it "
                        f"with 64-bit types"
                    )

    def _no_list_gradients(self, inputs):
        """A Tensor[] argument needing a gradient is refused at the call (autograd's
        ``setup_context``): the backward computes gradients of Tensor arguments only,
        and failed inside autograd's backward."""
        for name, t in zip(self._names, inputs):
            if isinstance(t, (list, tuple)) and any(_differentiable(x) for x in t):
                raise NotImplementedError(
                    f"{self.qualname}: argument {name!r} is a list of tensors and one of them "
                    "requires grad; a torchjax.pallas.op computes gradients for Tensor "
                    "arguments only. Pass those tensors as separate Tensor arguments, or "
                    "call the op under torch.no_grad() (or on detached tensors)"
                )

    def _forward_keeping_vjp(self, args, kwargs):
        """The outputs, the pullback riding on the first (Note [Kernel op backward]); None
        when no input needs a gradient or the inputs are traced."""
        bound = dict(zip(self._names, args), **kwargs)
        diff = tuple(n for n in self._tensors if _differentiable(bound.get(n)))
        if not diff:
            return None
        arrays = {n: to_jax(bound[n]) for n in self._tensors if bound.get(n) is not None}
        if any(isinstance(a, jax.core.Tracer) for a in arrays.values()):
            return None
        static = tuple((n, v) for n, v in bound.items() if n not in arrays)
        key = (diff, tuple(arrays), static)
        fwd = self._vjp_calls.get(key, 0)
        if fwd is None:  # Note [A kernel op without a derivative]
            return None
        if fwd == 0:
            fwd = self._vjp_calls[key] = self._make_vjp(diff, dict(static))
        others = {n: a for n, a in arrays.items() if n not in diff}
        try:
            outs, pullback = fwd([arrays[n] for n in diff], others)
        except (ValueError, NotImplementedError) as e:
            if not no_derivative(e):
                raise
            self._vjp_calls[key] = None
            return None
        results = [wrap(o) for o in outs]
        avals = [(o.shape, o.dtype) for o in outs]
        setattr(results[0], _VJP_ATTR, (pullback, diff, avals))
        return tuple(results) if self._multi else results[0]

    def _make_vjp(self, diff, static):
        fn = self._fn

        def fwd(diff_arrays, others):
            def f(*d):
                return jax.tree_util.tree_leaves(fn(**static, **others, **dict(zip(diff, d))))

            return jax.vjp(f, *diff_arrays)

        return jax.jit(fwd)

    def _eval_shape_fake(self, *args, **kwargs):
        # Only tensors become abstract values: scalars stay Python values (static), as
        # in the tpu implementation.
        self._no_wide_inputs(args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

        def f(*arrays):
            full = list(flat)
            for i, a in zip(where, arrays):
                full[i] = a
            a, k = pytree.tree_unflatten(full, spec)
            return self._fn(*a, **k)

        structs = jax.eval_shape(f, *(_to_struct(flat[i]) for i in where))
        like = next(x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor))
        outs = [
            like.new_empty(s.shape, dtype=to_torch_dtype(s.dtype))
            for s in jax.tree_util.tree_leaves(structs)
        ]
        return tuple(outs) if self._multi else outs[0]

    # -- autograd (Note [Kernel op backward]) --------------------------------------------

    def _define_backward(self, ns, opname):
        schema = self.op._schema
        text = str(schema)
        args = text[text.index("(") + 1 : text.rindex(") ->")]
        bname = f"{opname}_backward"
        self._lib.define(f"{bname}({args}, Tensor?[] grads) -> Tensor[]")
        self.backward_op = getattr(getattr(torch.ops, ns), bname).default
        names, tensors, fn, qualname = self._names, self._tensors, self._fn, self.qualname

        def vjp(*args, **kwargs):
            bound, grads = _bind_backward(names, args, kwargs)
            diff = [
                n
                for n in tensors
                if bound.get(n) is not None and jnp.issubdtype(bound[n].dtype, jnp.inexact)
            ]

            def f(*d):
                return fn(**dict(bound, **dict(zip(diff, d))))

            try:
                outs, pull = jax.vjp(f, *(bound[n] for n in diff))
            except (ValueError, NotImplementedError) as e:
                if not no_derivative(e):
                    raise
                raise no_derivative_error(qualname) from None
            flat_outs = jax.tree_util.tree_leaves(outs)
            cts = [
                jnp.zeros(o.shape, o.dtype) if g is None else g.astype(o.dtype)
                for o, g in zip(flat_outs, grads)
            ]
            tree = jax.tree_util.tree_structure(outs)
            d_in = dict(zip(diff, conj_vjp(pull, jax.tree_util.tree_unflatten(tree, cts))))
            # One entry per tensor argument; an empty float array stands for "no
            # gradient" (integer or absent inputs), mapped to None in ``_backward``.
            return [d_in.get(n, jnp.zeros((0,), jnp.float32)) for n in tensors]

        # An eager op, as the forward's plain call (Note [Kernel op backward]).
        tpu_backward = functional_handler(self.backward_op, vjp)

        def fake_backward(*args, **kwargs):
            bound, grads = _bind_backward(names, args, kwargs)
            like = next(g for g in grads if g is not None)
            out = []
            for n in tensors:
                t = bound.get(n)
                if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex):
                    out.append(torch.empty_like(t))
                else:
                    out.append(like.new_empty((0,), dtype=torch.float32))
            return out

        handler(self.backward_op)(tpu_backward)
        torch.library.register_fake(f"{ns}::{bname}", fake_backward, lib=self._lib)

        def setup_context(ctx, inputs, output):
            self._no_list_gradients(inputs)
            first = output[0] if isinstance(output, (tuple, list)) else output
            ctx.vjp = first.__dict__.pop(_VJP_ATTR, None)
            if ctx.vjp is not None:
                return
            ctx.inputs = inputs
            ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))

        def backward_from_vjp(ctx, grads):
            # Autograd calls this outside any torchjax op: x64 on, as the op's forward
            # ran, so a float64 cotangent stays float64. Note [Complex cotangents].
            pullback, diff, avals = ctx.vjp
            with x64(True):
                cts = []
                for g, (shape, dtype) in zip(grads, avals):
                    if not jnp.issubdtype(dtype, jnp.inexact):
                        cts.append(np.zeros(shape, jax.dtypes.float0))
                    elif g is None:
                        cts.append(jnp.zeros(shape, dtype))
                    else:
                        cts.append(to_jax(g).astype(dtype))
                by_name = dict(zip(diff, _PULL(pullback, cts)))
            return tuple(wrap(by_name[n]) if n in by_name else None for n in names)

        def backward(ctx, *grads):
            if ctx.vjp is not None:
                return backward_from_vjp(ctx, grads)
            saved = iter(ctx.saved_tensors)
            inputs = [next(saved) if isinstance(x, torch.Tensor) else x for x in ctx.inputs]
            d = self.backward_op(*inputs, grads=list(grads))
            by_name = dict(zip(tensors, d))
            result = []
            for n, x in zip(names, inputs):
                float_input = isinstance(x, torch.Tensor) and (
                    x.dtype.is_floating_point or x.dtype.is_complex
                )
                result.append(by_name[n] if float_input else None)
            return tuple(result)

        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=self._lib
        )
