"""JAX configuration torchjax relies on, gathered in one module.

Note [x64 without touching the user's JAX]
JAX disables 64-bit types by default (int64 becomes int32, float64 becomes float32).
torchjax needs them for honest dtypes, but must not flip ``jax_enable_x64`` for the
whole process: that would change the default dtypes of the user's own JAX code. So every
torchjax op runs with x64 enabled in a thread-local scope (what ``jax.enable_x64(True)``
sets). Arrays it produces keep their 64-bit dtypes when they leave (``torchjax.to_jax``);
the user's own ``jnp`` calls outside torchjax follow the user's x64 setting, so with x64
off they narrow 64-bit inputs as JAX always does.

The hot path (``JaxTensor.__torch_dispatch__``, once per ATen op) does not use the
``jax.enable_x64`` context manager itself (about 0.65 us to enter and leave, and a
slower jit call inside it): it swaps the same thread-local value with
``x64_enter``/``x64_exit`` (about 0.15 us), the two calls the context manager makes.
Compiled kernels are traced inside that scope, and jax keys its jit caches on the x64
setting, so a kernel traced with x64 on is never reused with x64 off.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import pxla as _pxla
from jax._src.lax import lax as _lax

x64 = jax.enable_x64

# The thread-local config state behind jax.enable_x64 (private: jax._src.config). It has
# no thread-local hook (checked by tests/compat/test_compat.py), so swap_local/set_local
# are exactly what the context manager does on enter/exit.
_X64_STATE = _config.enable_x64


def x64_enter():
    """Turn x64 on for this thread; returns the token ``x64_exit`` restores."""
    return _X64_STATE.swap_local(True)


def x64_exit(token) -> None:
    """Restore the thread's x64 setting saved by ``x64_enter``."""
    _X64_STATE.set_local(token)


def reset_persistent_cache() -> None:
    """Drop JAX's persistent-cache object, so the next compile looks up
    ``jax_compilation_cache_dir`` again (None: no cache). ``reset_cache`` is exported by
    ``jax.experimental.compilation_cache.compilation_cache``; it is the only way to make
    a directory change take effect after the first compile."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def clear_staging_caches() -> None:
    """Clear jax's Python-side staging caches (``jax._src.util.clear_all_caches``:
    every ``lu.cache``, ``util.cache`` and ``weakref_lru_cache``: traced jaxprs,
    lowerings, the Python path's compiled executables), and nothing else:
    ``jax.clear_caches()`` also empties every jitted function's C++ executable cache,
    which would make each of them compile again. Private API (jax._src.util), used by
    the cache budget (Note [Executable cache budget] in torchjax/_budget.py)."""
    from jax._src import util

    util.clear_all_caches()


# Note [Host arrays onto a device]
# ``jax.device_put`` of one NumPy array costs 40-70 us of Python on this 2-core CPU
# (pytree flattening, source and sharding inference, the general reshard dispatch);
# the transfer underneath it costs about 8 us. Every ``x.to("tpu")``, ``torch.tensor(...,
# device="tpu")``, new small tensor and 0-d CPU scalar in an op pays it, several times in
# a transformer forward. ``put_host`` makes the same call jax makes at the end of that
# path (``pxla.batched_device_put`` with the default device's single-device sharding,
# uncommitted when no device is named, inside ``explicit_device_put_scope`` so transfer
# guards see an explicit transfer, as they do for ``jax.device_put``) for the one case
# it handles: a NumPy array onto one addressable device. Anything else takes
# ``jax.device_put``. Private API (jax._src), checked by tests/compat/test_compat.py
# against ``jax.device_put``'s own result.
_SINGLE: dict = {}


# trace_state_clean() -> bool: False inside a jax trace (``jax.jit``, ``make_jaxpr``,
# compile-time evaluation), where a jitted call may bind into an outer program. jax's
# own function, not a wrapper: every eager op asks it. ``jax._src.core`` is private.
trace_state_clean = _core.trace_state_clean


def plain_eager() -> bool:
    """True outside every jax trace and mesh context: where a concrete single-device
    array may be passed to a jitted function as an argument of its own (inside a trace
    it becomes a constant of the outer program; under a mesh it would carry the mesh's
    sharding). ``jax._src.core.trace_state_clean`` is private."""
    return _core.trace_state_clean() and jax.sharding.get_abstract_mesh().empty


def weak_float(x) -> jax.Array:
    """The float jax value ``x`` as a weakly typed float64 scalar: it promotes as a
    Python float does (``bf16_array * w`` stays bfloat16). ``jax._src.lax.lax.
    _convert_element_type`` (its ``weak_type`` flag) is private."""
    return _lax._convert_element_type(x, np.dtype(np.float64), weak_type=True)


def trace_of(x):
    """The trace a tracer belongs to (``Tracer._trace``), None for a concrete value."""
    return getattr(x, "_trace", None) if isinstance(x, jax.core.Tracer) else None


def newest_traced_values(equations: int = 4) -> list:
    """The traced values that the newest ``equations`` equations of the program this
    thread is tracing read (``make_jaxpr``/``jit`` tracing), newest first; [] outside a
    trace or when jax's trace keeps no such record. Private: ``jax._src.core.trace_ctx``
    and the jaxpr trace's ``frame.tracing_eqns`` (entries or weak references to them,
    each with ``in_tracers``; jax 0.10)."""
    trace = _core.trace_ctx.trace
    eqns = getattr(getattr(trace, "frame", None), "tracing_eqns", None)
    if not eqns:
        return []
    out, seen = [], set()
    for item in reversed(eqns[-equations:]):
        eqn = item() if isinstance(item, weakref.ReferenceType) else item
        for t in getattr(eqn, "in_tracers", ()):
            if isinstance(t, _core.Tracer) and getattr(t, "_trace", None) is trace:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


def _constant_slice(x, max_equations: int):
    """(equations in order, {constvar: value}) by which the program this thread is
    tracing computes the traced ``x`` from constants alone (literals and concrete
    arrays); None when ``x`` reads an argument of the program or a value of an enclosing
    trace, an equation has effects, the slice has more than ``max_equations``
    equations, or jax's trace keeps no such record. Private: a jaxpr tracer's ``parent``
    equation (``in_tracers``, ``outvars``, ``effects``) and its frame's
    ``constvar_to_val`` (jax 0.10); checked by tests/compat/test_compat.py."""
    trace = getattr(x, "_trace", None)
    consts = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
    if consts is None or not hasattr(x, "parent"):
        return None
    order, done, constvars = [], set(), {}
    stack = [(x, False)]
    while stack:
        t, expanded = stack.pop()
        if getattr(t, "_trace", None) is not trace:
            return None
        val = t.val
        if isinstance(val, _core.Literal):
            continue
        if val in consts:
            if isinstance(consts[val], _core.Tracer):
                return None  # a value of an enclosing trace
            constvars[val] = consts[val]
            continue
        eqn = t.parent
        if eqn is None or eqn.effects:
            return None  # an argument of the program, or an effect
        if id(eqn) in done:
            continue
        if expanded:
            done.add(id(eqn))
            order.append(eqn)
            if len(order) > max_equations:
                return None
            continue
        stack.append((t, True))
        stack.extend((i, False) for i in eqn.in_tracers)
    return order, constvars


def constant_value(x, max_equations: int = 512):
    """The value of the traced ``x`` when it is computed from constants alone
    (``_constant_slice``), evaluated now as one small program of those equations; else
    None."""
    found = _constant_slice(x, max_equations)
    if found is None:
        return None
    order, constvars = found
    eqns = [
        _core.JaxprEqn(
            [i.val for i in e.in_tracers], e.outvars, e.primitive, e.params, e.effects,
            e.source_info, e.ctx,
        )
        for e in order
    ]  # fmt: skip
    info = _core.DebugInfo("torchjax.constant_value", "constant_value", (), ("value",))
    jaxpr = _core.Jaxpr(list(constvars), [], [x.val], eqns, debug_info=info)
    closed = _core.ClosedJaxpr(jaxpr, list(constvars.values()))
    with jax.ensure_compile_time_eval():
        (out,) = jax.jit(_core.jaxpr_as_fun(closed))()
    return out


def named(fun, name: str):
    """``fun`` under ``name``: jax names a program (its HLO module, its compile events'
    ``fun_name``, a profile's rows) after the function it jits, and ``jaxpr_as_fun`` gives
    every traced program the same name."""

    def program(*args):
        return fun(*args)

    program.__name__ = program.__qualname__ = name
    return program


# Arrays up to this size are read in place: the host copy jax keeps on them is small.
_READ_IN_PLACE_BYTES = 1 << 16


def _fresh(shard: jax.Array) -> jax.Array:
    """A new ``jax.Array`` over the same device buffer (no copy, public API): the host
    copy a read leaves on it goes when it goes."""
    return jax.make_array_from_single_device_arrays(shard.shape, shard.sharding, [shard])


def host_copy(arr: jax.Array) -> np.ndarray:
    """``np.asarray(jax.device_get(arr))`` that leaves no host copy held by ``arr``.

    A read of a ``jax.Array`` that has to copy (every read off a TPU) keeps the NumPy
    copy for later reads in two places: the Python attribute ``_npy_value`` and, below
    it, the array's C++ storage (jaxlib's ``PyArray`` host value, filled by
    ``_single_device_array_to_np_array_did_copy`` and ``copy_to_host_async``), both for
    as long as the array lives. torchjax reads a tensor's array for ``.cpu()``,
    ``.item()``, printing and every save, so a model saved on the chip kept its whole
    size in host memory afterwards (1.0x, measured). A large buffer is therefore read
    through a new ``jax.Array`` over the same device buffer, made for the read and
    dropped with its copy; a small one (up to ``_READ_IN_PLACE_BYTES``) is read in
    place. An array already cached, or not fully addressable, goes to ``np.asarray``
    (which raises for the latter, as before)."""
    if (
        not hasattr(arr, "_single_device_array_to_np_array_did_copy")
        or arr._npy_value is not None
        or not arr.is_fully_addressable
    ):
        return np.asarray(jax.device_get(arr))
    fresh = arr.nbytes > _READ_IN_PLACE_BYTES
    if arr.is_fully_replicated:
        shard = _fresh(arr.addressable_shards[0].data) if fresh else arr
        out = shard._single_device_array_to_np_array_did_copy()[0]
    else:
        shards = arr.addressable_shards
        datas = [_fresh(s.data) if fresh else s.data for s in shards]
        for d in datas:
            d.copy_to_host_async()
        out = np.empty(arr.shape, arr.dtype)
        for s, d in zip(shards, datas):
            out[s.index] = d._single_device_array_to_np_array_did_copy()[0]
    out.flags.writeable = False  # as np.asarray gives it: a jax array is immutable
    return out


def put_host(host, device=None, *, outside_mesh: bool = False) -> jax.Array:
    """``jax.device_put(host, device)`` for a NumPy array and a jax device (or None: the
    default device, uncommitted), through jax's own transfer call. ``outside_mesh``: put
    as outside any mesh context, whatever the context now (values made outside one and
    put when first read: Note [Host values of tensors made from host data])."""
    if (
        host.__class__ is not np.ndarray
        or not (device is None or isinstance(device, jax.Device))
        or not (outside_mesh or jax.sharding.get_abstract_mesh().empty)
    ):
        return jax.device_put(host, device)
    target = _pxla.get_default_device() if device is None else device
    sharding = _SINGLE.get(target)
    if sharding is None:
        if target.process_index != jax.process_index():
            return jax.device_put(host, device)
        sharding = _SINGLE[target] = jax.sharding.SingleDeviceSharding(target)
    with _config.explicit_device_put_scope():
        return _pxla.batched_device_put(
            _core.ShapedArray(host.shape, host.dtype),
            sharding,
            [host],
            [target],
            device is not None,
        )


def pallas_call_buffers(closed_jaxpr) -> list:
    """Every ``pallas_call`` in ``closed_jaxpr`` (nested jaxprs included), as
    ``(name, grid, buffers)``; ``buffers`` lists ``(role, shape, dtype, memory_space,
    buffer_count)`` with ``role`` "in", "out" or "scratch", ``shape`` the block as the
    kernel sees it (squeezed dims dropped), ``memory_space`` the ref's (None: the
    backend's default), ``buffer_count`` the BlockSpec's ``pipeline_mode`` buffering (None:
    the backend's default). The grid mapping is private (jax._src.pallas.core); this is
    its only reader, checked by tests/pallas/test_tiling.py."""
    import jax.extend as jex

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                buffers = []
                for n, bm in enumerate(gm.block_mappings):
                    role = "in" if n < gm.num_inputs else "out"
                    ref = bm.ref_aval
                    mode = bm.pipeline_mode
                    count = getattr(mode, "buffer_count", None) if mode is not None else None
                    space = getattr(ref, "memory_space", None)
                    buffers.append((role, tuple(ref.shape), ref.dtype, space, count))
                for aval in gm.scratch_avals:
                    space = getattr(aval, "memory_space", None)
                    buffers.append(("scratch", tuple(aval.shape), aval.dtype, space, 1))
                name = eqn.params.get("name") or getattr(
                    eqn.params.get("debug_info"), "func_name", "pallas_call"
                )
                found.append((str(name), tuple(gm.grid), buffers))
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


def backends_initialized() -> bool:
    """Whether this process started JAX's runtime clients (and their threads):
    ``jax._src.xla_bridge._backends`` (private), filled by the first ``jax.devices()``."""
    return bool(_xla_bridge._backends)


def mosaic_modules(stablehlo_text: str) -> list[str]:
    """The Mosaic (TPU Pallas) kernels in a lowered module's text, each as MLIR text.

    A kernel lowered for TPU is a ``tpu_custom_call`` whose backend config carries the
    kernel's Mosaic module as base64 MLIR bytecode; this reads each back with jax's own
    dialect registration and serde pass (``jax._src.tpu_custom_call``, private), as libtpu
    would receive it. Used to check on a machine without a TPU what Mosaic will be given
    (Note [Kernels trace in 32-bit mode]); checked by tests/pallas/test_lowering.py."""
    import base64
    import json
    import re

    from jax._src import tpu_custom_call
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    out = []
    for m in re.finditer(
        r'@tpu_custom_call\([^)]*\) \{backend_config = "((?:[^"\\]|\\.)*)"', stablehlo_text
    ):
        config = re.sub(r"\\([0-9A-Fa-f]{2})", lambda e: chr(int(e.group(1), 16)), m.group(1))
        body = base64.b64decode(json.loads(config)["custom_call_config"]["body"])
        ctx = mlir.make_ir_context()
        tpu_custom_call.tpu.register_dialect(ctx)
        with ctx, ir.Location.unknown():
            ctx.allow_unregistered_dialects = True
            module = ir.Module.parse(body)
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            out.append(str(module))
    return out
