"""JAX functions called from PyTorch code, with autograd through ``jax.vjp``.

``@torchjax.jax_function`` turns ``f`` (pytrees of jax arrays in and out) into a function
of torch tensors: tensor arguments cross with ``to_jax`` (no copy), outputs come back as
tpu tensors, and when autograd needs it the call is a ``torch.autograd.Function`` whose
backward is ``f``'s VJP. The forward runs ``jax.vjp`` under ``jax.jit`` and returns the
pullback itself (a ``jax.tree_util.Partial`` holding the residuals), so an eager call
costs one compiled forward and one compiled backward. Inside ``torchjax.jit`` the tensors
hold tracers and ``f`` simply becomes part of the traced program.

Note [Device checks in a jax function]
torchjax's own jax code (a Pallas kernel's wrapper: a page index outside the pool) states
value checks with ``torchjax.device._checks.require`` (Note [Device-side checks]). Under
this module's ``jax.jit`` its arrays are tracers, which ``require`` would drop as a user's
trace, so a call without gradient traces ``f`` collecting its checks: they come back as
extra outputs of the one executable and are queued (or raised, in immediate mode) as an
eager op's are; no host read. Inside ``torchjax.jit`` they are outputs of that
program (Note [Device checks of compiled programs] in torchjax/device/_checks.py). The
differentiable path (``jax.vjp``) does not collect them: a check made inside
``jax.vjp``'s trace cannot leave it. The collector is not strict: torch ops that ``f``
runs op by op skip a check needing values (``_checks.concrete``), as in a user's trace,
since a jax function has no op-by-op path.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import backward_keeps_graph, delayed_error, pytree
from torchjax.device import _checks
from torchjax.interop._convert import array_of as to_jax
from torchjax.tensor._tensor import JaxTensor, wrap


def jax_function(f=None, *, jit: bool = True):
    """Decorator: call the JAX function ``f`` on torch tensors, differentiably.

    Args:
        f: a function from pytrees of jax arrays (and static Python values) to a pytree of
            jax arrays.
        jit: compile ``f`` (and its VJP) with ``jax.jit``, one executable per combination
            of non-tensor arguments (which must then be hashable). ``False`` runs it
            eagerly, op by op.

    Returns:
        A function taking the same arguments with torch tensors where ``f`` takes arrays
        (tpu tensors cross without copies; CPU tensors are moved to tpu) and returning
        ``f``'s output pytree with every array as a tpu tensor. Floating outputs carry a
        ``grad_fn`` when any floating tensor input requires grad; ``backward()`` then
        runs ``jax.vjp`` of ``f``. Integer and bool outputs are not differentiable.
    """
    if f is None:
        return functools.partial(jax_function, jit=jit)
    return functools.wraps(f)(_JaxCallable(f, jit))


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


class _JaxCallable:
    def __init__(self, f, jit: bool):
        self.f = f
        self.jit = jit
        self._calls: dict = {}

    def __call__(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = tuple(i for i, x in enumerate(flat) if isinstance(x, torch.Tensor))
        tensors = [flat[i] for i in where]
        static = tuple(None if isinstance(x, torch.Tensor) else x for x in flat)
        grad = torch.is_grad_enabled() and any(_differentiable(t) for t in tensors)
        diff = tuple(k for k, t in enumerate(tensors) if grad and _differentiable(t))
        key = (spec, static, where, diff) if self.jit else None
        try:
            call = self._calls.get(key) if self.jit else None
        except TypeError:
            bad = next(type(x).__name__ for x in static if x is not None and not _hashable(x))
            raise TypeError(
                f"torchjax.jax_function({getattr(self.f, '__name__', self.f)!r}): non-tensor "
                f"arguments are static and must be hashable under jit=True, got {bad}; pass "
                "arrays as torch tensors, or use jax_function(jit=False)"
            ) from None
        if call is None:
            call = _Call(self.f, spec, static, where, diff, self.jit)
            if self.jit:
                self._calls[key] = call
        arrays = [to_jax(t) for t in tensors]
        if not diff:
            out = call.forward(arrays)
            return jax.tree_util.tree_map(wrap, out)
        outs = _VJP.apply(call, *tensors)
        return jax.tree_util.tree_unflatten(call.out_tree, outs)


class _Call:
    """``f`` specialised to one argument structure: forward, and VJP when ``diff``."""

    def __init__(self, f, spec, static, where, diff, jit):
        self.diff = diff
        self.out_tree = None

        def call(arrays):
            flat = list(static)
            for i, a in zip(where, arrays):
                flat[i] = a
            args, kwargs = pytree.tree_unflatten(flat, spec)
            return f(*args, **kwargs)

        def fwd(diff_arrays, other):
            def g(*d):
                arrays = list(other)
                for k, a in zip(diff, d):
                    arrays[k] = a
                return jax.tree_util.tree_flatten(call(arrays))[0]

            return jax.vjp(g, *diff_arrays)

        def bwd(pullback, cotangents):
            return conj_vjp(pullback, cotangents)

        def checked(arrays):
            # Note [Device checks in a jax function]: ``f``'s ``require`` checks become
            # outputs, queued by ``forward`` as an eager op's are.
            with _checks.collecting(strict=False) as collected:
                out = call(arrays)
            return out, _checks.outputs(collected)

        wrapjit = jax.jit if jit else (lambda fn: fn)
        self._checked = wrapjit(checked)
        self._fwd = wrapjit(fwd)
        self._bwd = wrapjit(bwd)
        self._call = call

    def forward(self, arrays):
        return _checks.finish(self._checked(arrays))

    def vjp(self, arrays):
        diff_arrays = [arrays[k] for k in self.diff]
        other = [None if k in self.diff else a for k, a in enumerate(arrays)]
        if self.out_tree is None:
            self.out_tree = jax.tree_util.tree_structure(jax.eval_shape(self._call, arrays))
        return self._fwd(diff_arrays, other)

    def pull(self, pullback, cotangents):
        return self._bwd(pullback, cotangents)


def _conj(tree):
    def conj(x):
        return jnp.conj(x) if jnp.iscomplexobj(x) else x

    return jax.tree_util.tree_map(conj, tree)


def conj_vjp(pullback, cotangents):
    """``pullback`` (a JAX VJP) applied by torch's complex convention:
    ``conj(vjp(conj(grad_out)))``, a no-op for real dtypes (Note [Complex cotangents] in
    torchjax/pallas/_op.py). Traced inside the jitted backward, not run op by op."""
    return _conj(pullback(_conj(cotangents)))


class _VJP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        arrays = [to_jax(t) for t in tensors]
        outs, pullback = call.vjp(arrays)
        ctx.call, ctx.pullback = call, pullback
        ctx.avals = [(o.shape, o.dtype) for o in outs]
        ctx.n_inputs = len(tensors)
        # Weak: held, the inputs' arrays would outlive the call as the graph's saved
        # tensors do not; only a double backward (below) reads them.
        ctx.inputs = {k: weakref.ref(tensors[k]) for k in call.diff}
        # Where the pullback holds residuals (CPU's graph would hold saved tensors), a
        # second backward() raises once the graph is freed, as on CPU; the residuals
        # themselves live in the pullback, the saved tensor only marks it.
        ctx.frees = bool(jax.tree_util.tree_leaves(pullback))
        wrap_outputs = getattr(call, "wrap_outputs", None)
        results = tuple(wrap_outputs(outs) if wrap_outputs else (wrap(o) for o in outs))
        saved_outputs = getattr(call, "saved_outputs", None)
        kept = [results[j] for j in saved_outputs()] if saved_outputs else []
        saved_inputs = getattr(call, "saved_inputs", None)
        kept += [tensors[k] for k in saved_inputs()] if saved_inputs else []
        ctx.checks_saved = ctx.frees or bool(kept)
        if ctx.checks_saved:
            # A tensor of its own marks the pullback (the inputs may be written after the
            # call); outputs and inputs the traced graph saved are saved as eager saves
            # them, so a write to one before backward() raises (Note [Outputs the
            # backward saved]).
            ctx.save_for_backward(torch.empty(0), *kept)
        constant = getattr(call, "constant_outputs", None)
        constant = constant() if constant else ()
        ctx.mark_non_differentiable(
            *(
                r
                for j, r in enumerate(results)
                if j in constant or not (r.dtype.is_floating_point or r.dtype.is_complex)
            )
        )
        return results

    @staticmethod
    def backward(ctx, *grads):
        if ctx.checks_saved:
            ctx.saved_tensors  # noqa: B018 - raises after the graph was freed or a write
        with_graph = getattr(ctx.call, "grads_with_graph", None)
        if with_graph is not None and torch.is_grad_enabled():
            # create_graph=True of a captured module call: Note [Double backward of a
            # captured call] in torchjax/compile/_captured_grad.py.
            grads_in = [None] * ctx.n_inputs
            for k, g in zip(ctx.call.diff, with_graph(grads)):
                grads_in[k] = g
            return (None, *grads_in)
        cts = []
        for g, (shape, dtype) in zip(grads, ctx.avals):
            if not jnp.issubdtype(dtype, jnp.inexact):
                cts.append(np.zeros(shape, jax.dtypes.float0))
            elif g is None:
                cts.append(jnp.zeros(shape, dtype))
            else:
                cts.append(g._value() if isinstance(g, JaxTensor) else to_jax(g))
        in_cts = ctx.call.pull(ctx.pullback, cts)
        wrap_grads = getattr(ctx.call, "wrap_input_grads", None)
        grads = wrap_grads(in_cts) if wrap_grads else [wrap(c) for c in in_cts]
        grads_in = [None] * ctx.n_inputs
        for k, g in zip(ctx.call.diff, grads):
            grads_in[k] = g
        if torch.is_grad_enabled():
            # create_graph=True: these gradients carry no graph, so differentiating
            # them (a gradient penalty) raises instead of silently missing terms.
            inputs = [ctx.inputs[k]() if k in ctx.inputs else None for k in range(ctx.n_inputs)]
            grads_in = list(delayed_error(_NO_DOUBLE_BACKWARD, grads_in, inputs))
        if ctx.checks_saved and not backward_keeps_graph():
            # torch frees the graph's saved tensors now (a second backward raises at
            # ctx.saved_tensors above), so the pullback's residuals and the arrays the
            # call read go too, as CPU's saved tensors do. Kept, the parameters the
            # call read stayed alive, and the optimizer step that follows had to copy
            # each one before donating it (Note [Donation never takes the user's copy]):
            # a compiled forward and step under torch.compile held the parameters
            # three times over.
            ctx.call = ctx.pullback = None
        return (None, *grads_in)


_NO_DOUBLE_BACKWARD = (
    "torchjax: a gradient of a compiled program (torchjax.jit, torch.compile(backend="
    "'tpu'), jax_function) was differentiated again (create_graph=True); its backward "
    "gives gradients without a graph. Compute the whole step, double backward included, "
    "inside one torchjax.jit function, where it is traced as on CPU."
)
