"""The checks each OpInfo sample runs on "tpu" against CPU: forward, backward, in-place
and ``out=`` (values, dtypes and shapes as ``opinfo.compare`` judges them), and the
structural checks of random and uninitialised outputs (Note [Random OpInfo samples]).
``run_check`` routes a sample to the right one."""

from __future__ import annotations

import functools
import types

import torch

from torchjax._compat.torch import pytree
from torchjax.testing.opinfo import (
    TOLERANCES,
    TPU,
    assert_refuses_like,
    call,
    clone_cpu,
    compare,
    differentiable_outputs,
    full_name,
    grad_leaves,
    map_tensors,
    to_tpu,
    weights_like,
)

# Entries whose outputs are defined only up to a gauge (eigenvectors up to sign or phase):
# LAPACK builds differ in the choice, so outputs are compared after the sample's own
# ``output_process_fn_grad`` (which takes ``abs`` of the eigenvectors), as torch's
# gradient tests do.
GAUGE_DEPENDENT = frozenset({"linalg.eig", "linalg.eigh"})
_HALF = (torch.float16, torch.bfloat16)


def check_forward(opinfo, sample, tol=None) -> None:
    """Forward values, dtypes and shapes vs CPU torch (Note [Half-precision accuracy])."""
    fn = opinfo.get_op()
    cpu = clone_cpu(sample, opinfo)
    expected = call(fn, cpu)
    got = call(fn, to_tpu(sample, opinfo))
    if full_name(opinfo) in GAUGE_DEPENDENT:
        process = sample.output_process_fn_grad
        got, expected = process(got), process(expected)
    what = f"{opinfo.name} forward"
    try:
        compare(got, expected, what, tol)
    except AssertionError:
        exact = _float64_result(fn, sample)
        if exact is None:
            raise
        compare_accuracy(got, expected, exact, what, tol)


# Note [Half-precision accuracy]
# In float16/bfloat16 CPU torch rounds intermediate results to half in kernel-specific
# places (a conv's partial sums, cross's partial products, an interpolation's weights),
# while our lowerings accumulate in float32 and round once, as ATen's CUDA kernels mostly
# do. Both are correct implementations; they differ by an ulp or two where CPU's rounding
# order loses accuracy. So a half-precision output that does not match CPU within the
# dtype's tolerance is judged against the same op computed in float64 on CPU: it passes
# where it is at least as accurate as CPU torch's own result, elementwise, within the
# dtype's tolerance (|tpu - exact| <= |cpu - exact| + atol + rtol * |exact|). Dtypes,
# shapes and non-floating outputs must still equal CPU's exactly.


def _float64_result(fn, sample):
    """``fn`` on ``sample`` with every float16/bfloat16 tensor upcast to float64, or None
    when the sample has no half-precision tensor or the op refuses the upcast inputs."""
    leaves = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))[0]
    if not any(isinstance(x, torch.Tensor) and x.dtype in _HALF for x in leaves):
        return None

    def upcast(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().to(torch.float64) if x.dtype in _HALF else x.detach().clone()

    try:
        return call(fn, map_tensors(upcast, sample))
    except (RuntimeError, TypeError, ValueError):
        return None


def compare_accuracy(got, expected, exact, what="output", tol=None) -> None:
    """Assert ``got`` (tpu) is at least as accurate as ``expected`` (CPU torch) against
    ``exact`` (float64), elementwise within the dtype's tolerance (Note [Half-precision
    accuracy]); structure, dtypes, shapes and non-floating outputs as :func:`compare`."""
    t_leaves, c_leaves, e_leaves = (pytree.tree_flatten(x)[0] for x in (got, expected, exact))
    assert len(t_leaves) == len(c_leaves) == len(e_leaves), f"{what}: output structure differs"
    for i, (t, c, e) in enumerate(zip(t_leaves, c_leaves, e_leaves)):
        name = f"{what}[{i}]"
        if not (isinstance(c, torch.Tensor) and c.dtype in _HALF):
            compare(t, c, name, tol)
            continue
        _compare_meta(t, c, name)
        dtype = c.dtype
        t, c, e = (x.detach().cpu().to(torch.float64) for x in (t, c, e))
        rtol, atol = tol or TOLERANCES[dtype]
        err_t, err_c = (t - e).abs(), (c - e).abs()
        ok = (t == c) | (t.isnan() & c.isnan()) | (err_t <= err_c + atol + rtol * e.abs())
        assert bool(ok.all()), (
            f"{name} ({dtype}): {int((~ok).sum())} of {ok.numel()} elements are "
            f"less accurate than CPU torch's against float64; worst |tpu - exact| "
            f"{(err_t - err_c)[~ok].max().item():.3g} beyond CPU's error"
        )


def check_backward(opinfo, sample, tol=None) -> bool:
    """Compare gradients; returns False when the sample has nothing differentiable."""
    fn = opinfo.get_op()
    cpu = clone_cpu(sample, opinfo)
    tpu = to_tpu(sample, opinfo)
    cpu_out = differentiable_outputs(call(fn, cpu))
    cpu_in = grad_leaves(cpu)
    if not cpu_out or not cpu_in:
        return False
    weights = weights_like(cpu_out)
    cpu_loss = sum(((o * w).sum() for o, w in zip(cpu_out, weights)))
    cpu_loss = cpu_loss.real if cpu_loss.is_complex() else cpu_loss
    cpu_grads = torch.autograd.grad(cpu_loss, cpu_in, allow_unused=True)
    tpu_out = differentiable_outputs(call(fn, tpu))
    tpu_in = grad_leaves(tpu)
    tpu_loss = sum(((o * w.to(TPU)).sum() for o, w in zip(tpu_out, weights)))
    tpu_loss = tpu_loss.real if tpu_loss.is_complex() else tpu_loss
    tpu_grads = torch.autograd.grad(tpu_loss, tpu_in, allow_unused=True)
    for i, (g, c) in enumerate(zip(tpu_grads, cpu_grads)):
        if c is None:
            assert g is None or not g.any().item(), f"grad[{i}]: CPU has none, tpu nonzero"
            continue
        assert g is not None, f"{opinfo.name} grad[{i}]: missing on tpu"
        compare(g, c, f"{opinfo.name} grad[{i}]", tol)
    return True


def check_inplace(opinfo, sample, tol=None) -> bool:
    """Run the in-place variant; returns False when it does not apply to the sample."""
    fn = opinfo.get_inplace()
    if fn is None or not isinstance(sample.input, torch.Tensor):
        return False
    cpu = clone_cpu(sample, opinfo)
    cpu.input = cpu.input.detach()  # clone_cpu copied it (keeping a whole storage)
    try:
        expected = fn(cpu.input, *cpu.args, **cpu.kwargs)
    except RuntimeError as e:  # torch refuses (dtype cast, broadcast): tpu must refuse too
        tpu = to_tpu(sample, opinfo)
        tpu.input = tpu.input.detach()
        assert_refuses_like(
            e, lambda: fn(tpu.input, *tpu.args, **tpu.kwargs), f"{opinfo.name} in-place"
        )
        return True
    tpu = to_tpu(sample, opinfo)
    tpu.input = tpu.input.detach()
    got = fn(tpu.input, *tpu.args, **tpu.kwargs)
    assert got is tpu.input, f"{opinfo.name} in-place: did not return self"
    compare(got, expected, f"{opinfo.name} in-place", tol)
    return True


def _empty_outs(expected, device):
    """0-element tensors on ``device`` shaped like ``expected``'s structure (a tensor, or
    a tuple/list of them, nested as the functional result is), with its dtypes, so every
    element is written and compared; a result without tensors gets one float tensor (the
    call must then be refused as on CPU)."""
    if isinstance(expected, torch.Tensor):
        return torch.empty(0, dtype=expected.dtype, device=device)
    if isinstance(expected, (tuple, list)) and expected:
        outs = [_empty_outs(e, device) for e in expected]
        return outs if isinstance(expected, list) else tuple(outs)
    return torch.empty(0, device=device)


def _check_returned_out(got, out, what):
    if isinstance(out, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(out), (
            f"{what}: returned {type(got)}"
        )
        for i, (g, o) in enumerate(zip(got, out)):
            if isinstance(o, (tuple, list)):
                _check_returned_out(g, o, f"{what}[{i}]")
            else:
                assert g is o, f"{what}: element {i} of the result is not out[{i}]"
    else:
        assert got is out, f"{what}: did not return out"


def check_out(opinfo, sample, tol=None) -> bool:
    """Run with ``out=`` (0-element tensors of the functional result's dtypes, one per
    output for multi-output ops) on CPU and on tpu and compare what was written; where
    CPU torch refuses that ``out=`` (an overload without one, a form its parser rejects),
    tpu must refuse with the same exception type. False when ``opinfo`` has no out=."""
    if not opinfo.supports_out:
        return False
    fn = opinfo.get_op()
    cpu = clone_cpu(sample, opinfo)
    expected = call(fn, cpu)
    what = f"{opinfo.name} out="
    tpu = to_tpu(sample, opinfo)
    cpu_out, out = _empty_outs(expected, "cpu"), _empty_outs(expected, TPU)
    try:
        cpu_returned = fn(cpu.input, *cpu.args, **cpu.kwargs, out=cpu_out)
    except (RuntimeError, TypeError, ValueError) as e:
        assert_refuses_like(e, lambda: fn(tpu.input, *tpu.args, **tpu.kwargs, out=out), what)
        return True
    got = fn(tpu.input, *tpu.args, **tpu.kwargs, out=out)
    if cpu_returned is None:  # list outs (``Tensor(a!)[] out``): the op returns nothing
        assert got is None, f"{what}: returned {type(got)}, CPU returned None"
    else:
        _check_returned_out(got, out, what)
    if full_name(opinfo) in GAUGE_DEPENDENT:
        out, cpu_out = sample.output_process_fn_grad(out), sample.output_process_fn_grad(cpu_out)
    compare(out, cpu_out, what, tol)
    return True


# ---------------------------------------------------------------------------------------
# Random-output ops
#
# Note [Random OpInfo samples]
# torchjax draws random bits from its own generator (see torchjax/tensor/random.py), so a
# random op's values cannot equal CPU torch's. OpInfo marks such ops by wrapping them in
# ``wrapper_set_seed`` (their ``op`` is a lambda calling it, which reseeds with 42 before
# every call: we call the op without it, see ``_unseeded``); some of their samples are
# deterministic all the same (dropout with p=0 or training=False, bernoulli with p in
# {0, 1}, ``item``). CPU torch is the oracle for which is which: a sample whose five
# successive CPU calls give equal outputs is compared by value as usual; for the others we
# check structure, dtype, shape, device, the distribution's support (``_SUPPORT``),
# finiteness, and determinism: the same ``torch.manual_seed`` gives the same values, and
# successive calls (or another seed) give different ones.

# Outputs are uninitialised memory: only structure, dtype, shape and device are compared.
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
)

# Draws until a successive call (or another seed) changes the output. A correct sampler on
# a tiny sample (bernoulli of one element) repeats a value with probability up to 1/2.
_REDRAWS = 16


def is_random(opinfo) -> bool:
    """True for op_db entries whose samples may draw random numbers (Note [Random OpInfo
    samples]); their checks go through :func:`check_random`."""
    code = getattr(opinfo.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names + code.co_freevars


def _dropout_support(sample, out):
    x, kw = sample.input, sample.kwargs
    p = kw.get("p", sample.args[0] if sample.args else 0.5)
    if not kw.get("training", True) or p >= 1:
        return
    kept = out != 0
    scaled = x * (1 / (1 - p))
    torch.testing.assert_close(out[kept], scaled[kept], msg="kept values are not x / (1 - p)")


def _rrelu_support(sample, out):
    x, kw = sample.input, sample.kwargs
    lo, hi = kw.get("lower", 1 / 8), kw.get("upper", 1 / 3)
    pos = x >= 0
    torch.testing.assert_close(out[pos], x[pos], msg="rrelu changed x >= 0")
    slope = (out[~pos] / x[~pos]).double()
    assert ((slope >= lo - 1e-2) & (slope <= hi + 1e-2)).all(), f"slopes outside [{lo}, {hi}]"


def _randint_bounds(sample):
    nums = [a for a in (sample.input, *sample.args) if isinstance(a, int)]
    return (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])


def _within(lo, hi, closed_hi=True):
    def check(sample, out):
        v = out.double()
        assert (v >= lo).all() and ((v <= hi) if closed_hi else (v < hi)).all(), (
            f"values outside [{lo}, {hi}{']' if closed_hi else ')'}: "
            f"min {v.min().item()}, max {v.max().item()}"
        )

    return check


def _integral(out):
    assert (out.double() == out.double().round()).all(), "values are not integral"


# Support of each sampler, given the sample and one output tensor (moved to CPU).
_SUPPORT = {
    "bernoulli": lambda s, o: _within(0, 1)(s, o) or _integral(o),
    "uniform": lambda s, o: _within(*s.args[:2])(s, o),
    "exponential": _within(0, float("inf")),
    "geometric": lambda s, o: _within(1, float("inf"))(s, o) or _integral(o),
    "log_normal": _within(0, float("inf")),
    # op_db's "rand_like" entry calls torch.randn_like (no bounded support to check).
    "randint": lambda s, o: _within(*_randint_bounds(s), closed_hi=False)(s, o) or _integral(o),
    "randint_like": lambda s, o: (
        _within(*_randint_bounds(s), closed_hi=False)(s, o) or _integral(o)
    ),
    "multinomial": lambda s, o: (
        _within(0, s.input.shape[-1], closed_hi=False)(s, o)
        or _check(bool((s.input.gather(-1, o) > 0).all()), "drew a zero-probability category")
        if o.numel()
        else None
    ),
    "nn.functional.dropout": _dropout_support,
    "nn.functional.dropout2d": _dropout_support,
    "nn.functional.dropout3d": _dropout_support,
    "nn.functional.rrelu": _rrelu_support,
    "nn.functional.fractional_max_pool2d": lambda s, o: _check(
        bool(torch.isin(o, s.input).all()) if o.is_floating_point() else True,
        "pooled values that are not input values",
    ),
    "nn.functional.fractional_max_pool3d": lambda s, o: _check(
        bool(torch.isin(o, s.input).all()) if o.is_floating_point() else True,
        "pooled values that are not input values",
    ),
}


def _check(cond: bool, what: str) -> None:
    assert cond, what


def _leaves(out):
    return [x for x in pytree.tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


def _identical(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and bool(
            torch.eq(x.cpu(), y.cpu()).logical_or(x.cpu().ne(x.cpu()) & y.cpu().ne(y.cpu())).all()
        )
        for x, y in zip(la, lb)
    )


def _compare_meta(got, expected, what):
    t_leaves, c_leaves = _leaves(got), _leaves(expected)
    assert len(t_leaves) == len(c_leaves), f"{what}: {len(t_leaves)} tensors vs {len(c_leaves)}"
    for i, (t, c) in enumerate(zip(t_leaves, c_leaves)):
        name = f"{what}[{i}]"
        assert t.device.type == TPU, f"{name}: result on {t.device}, expected tpu"
        assert t.dtype == c.dtype, f"{name}: dtype {t.dtype}, CPU gave {c.dtype}"
        assert t.shape == c.shape, f"{name}: shape {tuple(t.shape)}, CPU gave {tuple(c.shape)}"


def _run_variant(opinfo, variant, sample, out_like=None):
    """One call of the op (``variant``: "forward", "inplace" or "out") on ``sample``'s
    tensors as given, seeded by the caller; returns the output (self for in-place, out for
    out=: tpu tensors shaped like ``out_like``'s structure)."""
    if variant == "inplace":
        inp = sample.input.detach()
        return _unseeded(opinfo.get_inplace())(inp, *sample.args, **sample.kwargs)
    fn = _unseeded(opinfo.get_op())
    if variant == "out":
        out = _empty_outs(out_like, TPU)
        got = fn(sample.input, *sample.args, **sample.kwargs, out=out)
        _check_returned_out(got, out, f"{full_name(opinfo)} out=")
        return out
    return call(fn, sample)


def _call_through(op, *args, **kwargs):
    return op(*args, **kwargs)


@functools.cache
def _unseeded(fn):
    """``fn`` with OpInfo's ``wrapper_set_seed`` (which calls ``torch.manual_seed(42)``
    before every call, so successive calls repeat) replaced by a plain call: the seed is
    then ours to set. A copy of the function with its own globals; nothing is patched."""
    code = getattr(fn, "__code__", None)
    if code is None or "wrapper_set_seed" not in code.co_names:
        return fn
    env = {**fn.__globals__, "wrapper_set_seed": _call_through}
    return types.FunctionType(code, env, fn.__name__, fn.__defaults__, fn.__closure__)


def _seeded(seed, fn, *args):
    torch.manual_seed(seed)
    return fn(*args)


def check_random(opinfo, sample, variant="forward", tol=None) -> bool:
    """Check a random op's sample (Note [Random OpInfo samples]) in ``variant`` (forward,
    inplace or out). Returns False when the variant does not apply to the sample."""
    if variant == "inplace" and (
        opinfo.get_inplace() is None or not isinstance(sample.input, torch.Tensor)
    ):
        return False
    if variant == "out" and not opinfo.supports_out:
        return False
    what = f"{full_name(opinfo)} {variant}"
    # CPU runs the functional form for out= (as check_out does): ATen's CPU out= kernels
    # of some samplers refuse a 0-element out that the functional result would resize.
    cpu_run = lambda s: _run_variant(opinfo, "forward" if variant == "out" else variant, s)  # noqa: E731
    try:
        c1 = _seeded(0, cpu_run, clone_cpu(sample, opinfo))
    except RuntimeError as e:  # torch refuses (dtype cast, broadcast): tpu must refuse too
        assert_refuses_like(e, lambda: _run_variant(opinfo, variant, to_tpu(sample, opinfo)), what)
        return True
    if variant == "out" and not _leaves(c1):
        return False
    run = lambda s: _run_variant(opinfo, variant, s, c1)  # noqa: E731
    # Several successive CPU draws: a permutation of 3 categories repeats by chance.
    if all(_identical(c1, cpu_run(clone_cpu(sample, opinfo))) for _ in range(4)):
        got = _seeded(0, run, to_tpu(sample, opinfo))  # a deterministic sample: compare values
        compare(got, c1, what, tol)
        return True
    t1 = _seeded(0, run, to_tpu(sample, opinfo))
    _compare_meta(t1, c1, what)
    t1_again = _seeded(0, run, to_tpu(sample, opinfo))
    assert _identical(t1, t1_again), f"{what}: same torch.manual_seed gave different values"
    for i, (t, c) in enumerate(zip(_leaves(t1), _leaves(c1))):
        t = t.detach().cpu()
        if c.is_floating_point() and torch.isfinite(c).all():
            assert torch.isfinite(t).all(), f"{what}[{i}]: non-finite values, CPU's are finite"
        if i == 0 and full_name(opinfo) in _SUPPORT:
            _SUPPORT[full_name(opinfo)](clone_cpu(sample, opinfo), t)
    assert any(not _identical(t1_again, run(to_tpu(sample, opinfo))) for _ in range(_REDRAWS)), (
        f"{what}: successive calls gave the same values"
    )
    assert any(
        not _identical(t1, _seeded(seed, run, to_tpu(sample, opinfo)))
        for seed in range(1, _REDRAWS + 1)
    ), f"{what}: another seed gave the same values"
    return True


def check_random_backward(opinfo, sample, tol=None) -> bool:
    """Backward of a random op: value-checked where the CPU sample is deterministic, else
    gradients' dtype, shape, finiteness and determinism under ``torch.manual_seed``."""
    fn = _unseeded(opinfo.get_op())

    def grads(s):
        out = differentiable_outputs(call(fn, s))
        inputs = grad_leaves(s)
        if not out or not inputs:
            return None
        weights = weights_like([o.detach().cpu() for o in out])
        loss = sum((o * w.to(o.device)).sum() for o, w in zip(out, weights))
        loss = loss.real if loss.is_complex() else loss
        return torch.autograd.grad(loss, inputs, allow_unused=True)

    c1 = _seeded(0, grads, clone_cpu(sample, opinfo))
    if c1 is None:
        return False
    if all(_identical(c1, grads(clone_cpu(sample, opinfo))) for _ in range(4)):
        torch.manual_seed(0)
        return check_backward(opinfo, sample, tol)
    t1 = _seeded(0, grads, to_tpu(sample, opinfo))
    assert t1 is not None, f"{full_name(opinfo)} backward: no differentiable output on tpu"
    for i, (g, c) in enumerate(zip(t1, c1)):
        what = f"{full_name(opinfo)} grad[{i}]"
        if c is None:
            continue
        assert g is not None, f"{what}: missing on tpu"
        _compare_meta(g, c, what)
        if torch.isfinite(c).all():
            assert torch.isfinite(g.cpu()).all(), f"{what}: non-finite, CPU's is finite"
    t2 = _seeded(0, grads, to_tpu(sample, opinfo))
    assert _identical([g for g in t1 if g is not None], [g for g in t2 if g is not None]), (
        f"{full_name(opinfo)} backward: same torch.manual_seed gave different gradients"
    )
    return True


def check_uninitialized(opinfo, sample, variant="forward", tol=None) -> bool:
    """``empty``-like ops: structure, dtype, shape and device only (values are garbage)."""
    if variant != "forward":
        return False
    _compare_meta(
        call(opinfo.get_op(), to_tpu(sample, opinfo)),
        call(opinfo.get_op(), clone_cpu(sample, opinfo)),
        f"{full_name(opinfo)} forward",
    )
    return True


def run_check(check: str, opinfo, sample, tol=None):
    """Run ``check`` ("forward", "backward", "inplace", "out") on one sample, routing
    random ops to :func:`check_random` and empty-like ops to :func:`check_uninitialized`.
    Returns False when the check does not apply to the sample."""
    if full_name(opinfo) in UNINITIALIZED:
        return check_uninitialized(opinfo, sample, check, tol)
    if is_random(opinfo):
        if check == "backward":
            return check_random_backward(opinfo, sample, tol)
        return check_random(opinfo, sample, check, tol)
    result = globals()[f"check_{check}"](opinfo, sample, tol)
    return True if result is None else result
