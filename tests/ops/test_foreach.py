"""torchjax/ops/foreach.py: the ``_foreach_*`` family, and the optimizers and utilities
that call it (foreach and fused), each compared with CPU torch.

``_foreach_*`` OpInfos live in their own databases (``foreach_*_op_db``), not in
``op_db``, so the sweep here runs their samples directly: functional and in-place, on
float32, bfloat16 and int64 (the list machinery is dtype-blind; the per-tensor ops have
their own full dtype sweeps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing._internal import common_methods_invocations as cmi

import torchjax
from tests.ops.opinfo_cases import XFAILS
from torchjax.testing import opinfo as oi

TPU = "tpu"
_DBS = (
    cmi.foreach_unary_op_db
    + cmi.foreach_binary_op_db
    + cmi.foreach_pointwise_op_db
    + cmi.foreach_reduce_op_db
    + cmi.foreach_other_op_db
)
_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
# The first samples only, as the OpInfo families do (Note [Sample caps] in
# tests/ops/opinfo_cases.py): the list lengths and scalar/list forms vary across them.
_SAMPLE_LIMIT = 3


def _cases(check):
    cases = []
    for op in _DBS:
        if check == "inplace" and op.inplace_variant is None:
            continue
        for dtype in _DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            key = (op.name, str(dtype).removeprefix("torch."), check)
            marks = [pytest.mark.xfail(reason=XFAILS[key], strict=True)] if key in XFAILS else []
            cases.append(pytest.param(op, dtype, id=f"{key[0]}-{key[1]}", marks=marks))
    return cases


def _samples(op, dtype):
    return oi.samples(op, dtype, limit=_SAMPLE_LIMIT, num_input_tensors=[2])


def _run(fn, sample):
    try:
        return fn(sample.input, *sample.args, **sample.kwargs), None
    except RuntimeError as e:
        return None, e


def _call(fn, sample):
    return fn(sample.input, *sample.args, **sample.kwargs)


@pytest.mark.parametrize("op,dtype", _cases("forward"))
def test_foreach_forward(op, dtype):
    samples = _samples(op, dtype)
    assert samples, f"{op.name} has no {dtype} sample: nothing would be compared"
    for s in samples:
        expected, err = _run(op.op, oi.clone_cpu(s))
        if err is not None:  # torch refuses: tpu must refuse with the same type
            oi.assert_refuses_like(err, lambda s=s: _call(op.op, oi.to_tpu(s)), op.name)
            continue
        oi.compare(_call(op.op, oi.to_tpu(s)), expected, f"{op.name} forward")


@pytest.mark.parametrize("op,dtype", _cases("inplace"))
def test_foreach_inplace(op, dtype):
    samples = _samples(op, dtype)
    assert samples, f"{op.name} has no {dtype} sample: nothing would be compared"
    for s in samples:
        cpu, tpu = oi.clone_cpu(s), oi.to_tpu(s)
        cpu.input = [t.detach() for t in cpu.input]
        tpu.input = [t.detach() for t in tpu.input]
        _, err = _run(op.inplace_variant, cpu)
        if err is not None:  # torch refuses: tpu must refuse with the same type
            oi.assert_refuses_like(err, lambda t=tpu: _call(op.inplace_variant, t), f"{op.name}_")
            continue
        _call(op.inplace_variant, tpu)
        oi.compare(tpu.input, cpu.input, f"{op.name}_ self")


def test_foreach_inplace_through_view():
    base = torch.randn(4, 6)
    tbase = base.to(TPU)
    views, tviews = [base[1], base[:, 2]], [tbase[1], tbase[:, 2]]
    torch._foreach_mul_(views, 3.0)
    torch._foreach_add_(views, [torch.ones(6), torch.ones(4)], alpha=2)
    torch._foreach_mul_(tviews, 3.0)
    torch._foreach_add_(tviews, [torch.ones(6, device=TPU), torch.ones(4, device=TPU)], alpha=2)
    oi.compare(tbase, base)


def test_foreach_out():
    xs = [torch.randn(3), torch.randn(2, 2)]
    outs = [torch.empty(0, device=TPU), torch.empty(0, device=TPU)]
    torch.ops.aten._foreach_mul.Scalar_out([x.to(TPU) for x in xs], 2.0, out=outs)
    oi.compare(outs, [x * 2 for x in xs])


def test_foreach_inplace_cast_error():
    ts = [torch.ones(3, dtype=torch.int64, device=TPU)]
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch._foreach_add_(ts, 1.5)


def test_foreach_length_mismatch():
    xs = [torch.ones(3, device=TPU), torch.ones(2, device=TPU)]
    with pytest.raises(RuntimeError, match="same number of"):
        torch._foreach_add(xs, [torch.ones(3, device=TPU)])


def test_foreach_backward():
    xs = [torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True)]
    txs = oi.to_tpu(xs)
    for inputs in (xs, txs):
        ys = torch._foreach_mul(torch._foreach_exp(inputs), 3.0)
        sum(y.sum() for y in ys).backward()
    for t, c in zip(txs, xs):
        oi.compare(t.grad, c.grad, "grad")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


# Every foreach and fused optimizer path, checked eagerly and inside torchjax.jit.
_OPTIMIZER_CASES = pytest.mark.parametrize(
    "opt_cls,kwargs",
    [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True)),
        (torch.optim.Adam, dict(lr=0.01, foreach=True)),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
        (torch.optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True, fused=True)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, fused=True)),
        (torch.optim.SGD, dict(lr=0.1, weight_decay=0.01, maximize=True, fused=True)),
    ],
    ids=[
        "sgd-foreach",
        "adam-foreach",
        "adamw-foreach",
        "adamw-fused",
        "adam-fused-ams",
        "sgd-fused-nesterov",
        "sgd-fused-plain",
    ],
)


@_OPTIMIZER_CASES
def test_optimizer_steps(opt_cls, kwargs):
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(5, 4)
    runs = []
    for model, inp in ((cpu_model, x), (tpu_model, x.to(TPU))):
        opt = opt_cls(model.parameters(), **kwargs)
        for _ in range(3):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()
        runs.append(model)
    for t, c in zip(tpu_model.parameters(), cpu_model.parameters()):
        oi.compare(t.detach(), c.detach(), "param", tol=(1e-5, 1e-5))


@_OPTIMIZER_CASES
def test_optimizer_steps_inside_torchjax_jit(opt_cls, kwargs):
    # The compiled foreach path nests a jax.jit; inside a torchjax.jit trace it must run
    # inline (jax refuses compiler_options on a nested jit), with eager CPU's numbers.
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    opt_cpu = opt_cls(cpu_model.parameters(), **kwargs)
    opt_tpu = opt_cls(tpu_model.parameters(), **kwargs)

    def train(model, opt, inp):
        model(inp).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    step = torchjax.jit(lambda inp: train(tpu_model, opt_tpu, inp))
    x = torch.randn(5, 4)
    for i in range(3):
        train(cpu_model, opt_cpu, x)
        step(x.to(TPU))
        for t, c in zip(tpu_model.parameters(), cpu_model.parameters()):
            oi.compare(t.detach(), c.detach(), f"param after step {i}", tol=(1e-5, 1e-5))
    assert step.trace_count <= 2  # the first step may create optimizer state


def test_clip_grad_norm_foreach():
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(5, 4)
    norms = []
    for model, inp in ((cpu_model, x), (tpu_model, x.to(TPU))):
        model(inp).pow(2).sum().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True))
    oi.compare(norms[1], norms[0], "total norm")
    for t, c in zip(tpu_model.parameters(), cpu_model.parameters()):
        oi.compare(t.grad, c.grad, "clipped grad")


@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
def test_foreach_addc_with_scalar_lists_bit_for_bit(op):
    # The compiled foreach path takes the per-tensor values as traced inputs; it must
    # compute in the per-tensor lowering's order, (value * t1) op t2 and addcmul's FMA,
    # as Adam's foreach step calls it (exp_avg_sq, param updates).
    g = torch.Generator().manual_seed(0)
    lists = [[torch.randn(1024, generator=g) for _ in range(2)] for _ in range(3)]
    lists[2] = [t.abs() + 0.5 for t in lists[2]]
    values = [-0.001, 2.5]
    results = []
    for dev in ("cpu", TPU):
        selves, t1, t2 = ([t.clone().to(dev) for t in ts] for ts in lists)
        getattr(torch, f"_foreach_{op}_")(selves, t1, t2, values)
        results.append([t.cpu() for t in selves])
    assert len(results[0]) == 2
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


_SCALAR_LIST_OPS = ["add", "sub", "mul", "div", "pow", "maximum", "minimum"]
_ZERO_D_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.complex64]


def _zero_d_lists(dtype):
    # 0-d elements beside a 1-d one: the 0-d ones promoted as peers of the scalars.
    values = [torch.tensor(1.25), torch.tensor(-0.5), torch.tensor([2.0, 3.0])]
    return [v.to(dtype) for v in values], [0.1, 1.001, 3]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", _ZERO_D_DTYPES, ids=str)
@pytest.mark.parametrize("op", _SCALAR_LIST_OPS)
def test_scalar_lists_on_0d_tensors_keep_the_tensor_dtype(op, dtype, jit):
    fn = getattr(torch, f"_foreach_{op}")
    tensors, scalars = _zero_d_lists(dtype)
    tpu = [t.to(TPU) for t in tensors]
    run = torchjax.jit(lambda ts: fn(ts, scalars)) if jit else (lambda ts: fn(ts, scalars))
    if dtype.is_complex and op in ("maximum", "minimum"):
        # torch has no complex ordering: refused on both, with torch's error type.
        with pytest.raises(RuntimeError) as cpu_error:
            fn(tensors, scalars)
        with pytest.raises(type(cpu_error.value)):
            run(tpu)
        return
    want = fn(tensors, scalars)
    got = run(tpu)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, equal_nan=True)


_LIST_OPS = {
    "lerp": lambda a, b: torch._foreach_lerp(a, b, b),
    "lerp_": lambda a, b: torch._foreach_lerp_(a, b, b),
    "clamp_min": lambda a, b: torch._foreach_clamp_min(a, b),
    "clamp_max_": lambda a, b: torch._foreach_clamp_max_(a, b),
    "pow_": lambda a, b: torch._foreach_pow_(a, b),
    "maximum": lambda a, b: torch._foreach_maximum(a, b),
}


@pytest.mark.parametrize("name", sorted(_LIST_OPS))
def test_list_ops_trace_and_compile(name):
    # Per-element ops were called as packets, whose overload resolution formats (reads)
    # each tensor: a host read per element eagerly, an error under torchjax.jit.
    import jax

    fn = _LIST_OPS[name]
    torch.manual_seed(0)
    a = [torch.rand(3) + 0.5, torch.rand(2, 2) + 0.5]
    b = [torch.rand(3), torch.rand(2, 2)]

    def run(xs, ys):
        out = fn(xs, ys)
        return xs if out is None else out

    want = run([t.clone() for t in a], b)
    tb = [t.to(TPU) for t in b]
    got_jit = torchjax.jit(run)([t.to(TPU) for t in a], tb)
    xs = [t.to(TPU) for t in a]
    run(xs, tb)  # first call compiles
    xs = [t.to(TPU) for t in a]
    with jax.transfer_guard_device_to_host("disallow"):
        got = run(xs, tb)
    for g, gj, w in zip(got, got_jit, want):
        torch.testing.assert_close(g.cpu(), w)
        torch.testing.assert_close(gj.cpu(), w)


_OVERLAPS = {
    "add_shifted": lambda y: torch._foreach_add_([y[0:3]], [y[1:4]]),
    "copy_shifted": lambda y: torch._foreach_copy_([y[0:3]], [y[1:4]]),
    "mul_same_view": lambda y: torch._foreach_mul_([y[0:3]], [y[0:3]]),
    "add_equal_view": lambda y: torch._foreach_add_([y[0:3]], [y.view(2, 3)[0]]),
    "add_strided": lambda y: torch._foreach_add_([y[0:3]], [y[::2]]),
}


@pytest.mark.parametrize("name", sorted(_OVERLAPS))
def test_inplace_overlap_with_its_own_element_as_cpu(name):
    # A source that partly overlaps the tensor written at the same index is refused by
    # torch; the same memory seen as the same view is allowed.
    outcomes = {}
    for device in ("cpu", TPU):
        y = torch.arange(6.0).to(device)
        try:
            _OVERLAPS[name](y)
            outcomes[device] = y.tolist()
        except RuntimeError as e:
            outcomes[device] = (type(e), str(e).split(" (in aten::")[0][:120])
    assert outcomes[TPU] == outcomes["cpu"]


_CHECKED_LISTS = {
    "maximum": lambda ts, s: torch._foreach_maximum(ts, s),
    "minimum_": lambda ts, s: torch._foreach_minimum_(ts, s),
    "clamp_min": lambda ts, s: torch._foreach_clamp_min(ts, s),
    "clamp_max_": lambda ts, s: torch._foreach_clamp_max_(ts, s),
    "pow": lambda ts, s: torch._foreach_pow(ts, s),
    "add": lambda ts, s: torch._foreach_add(ts, s),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(_CHECKED_LISTS))
def test_number_lists_that_do_not_fit_raise_as_cpu(name, dtype):
    # The compiled path passes number lists as tensors; the per-element ops that read a
    # number as the tensor's type (clamp, half pow) check it on CPU.
    def outcome(device):
        ts = [torch.ones(2, dtype=dtype).to(device), torch.ones(3, dtype=dtype).to(device)]
        try:
            out = _CHECKED_LISTS[name](ts, [1.5, 1e39])
            return [t.cpu().tolist() for t in (ts if out is None else out)]
        except RuntimeError as e:
            return type(e), str(e).split(" (in aten::")[0]

    assert outcome(TPU) == outcome("cpu")


def _chain(xs, ys, big, scale):
    """Functional and in-place foreach ops on values the previous ones made, a view of
    one in a list, a 0-d tensor argument and a norm."""
    a = torch._foreach_mul(xs, 2.0)
    torch._foreach_add_(a, ys, alpha=0.5)
    torch._foreach_mul_(a, scale)
    b = torch._foreach_addcmul(a, [big[0], big[1]], ys, value=0.25)
    torch._foreach_sqrt_(b)
    return a + b + torch._foreach_norm(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_foreach_ops_are_one_recorded_node_each_in_fused_eager(dtype):
    # Note [Recorded foreach ops]: values recorded before (a foreach result, the rows of
    # a recorded tensor) enter unread, each call is one node, the chain one program,
    # with plain eager's bits (and CPU's but for float32 sqrt's last bit, which CPU does
    # not round correctly: docs/numerics.md).
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 64, generator=g).abs().to(dtype) for _ in range(2)]
    ys = [torch.randn(2, 64, generator=g).abs().to(dtype) for _ in range(2)]
    big = torch.randn(2, 2, 64, generator=g).abs().to(dtype)
    scale = torch.tensor(3.0, dtype=dtype)
    want = _chain(xs, ys, big * 2, scale)
    txs, tys, tbig = [x.to(TPU) for x in xs], [y.to(TPU) for y in ys], big.to(TPU)
    counted, eager = [], None
    for fused in (False, True, True):  # eager; fused builds the program; fused again
        torch.tpu.synchronize()
        before = torchjax.stats()
        with torchjax.fused(fused):
            got = _chain(txs, tys, tbig * 2, scale.to(TPU))
        got = [t.cpu() for t in got]
        after = torchjax.stats()
        counted.append({k: after[k] - before[k] for k in ("fused_ops", "fused_segments")})
        ops = {k: v for k, v in after["ops"].items() if k.startswith("aten::_foreach_")}
        assert all(v["op_by_op"] == before["ops"].get(k, v)["op_by_op"] for k, v in ops.items())
        if eager is None:
            eager = got
            for gt, w in zip(got, want, strict=True):
                torch.testing.assert_close(gt, w, rtol=2e-7, atol=0)
        for gt, e in zip(got, eager, strict=True):
            assert torch.equal(gt, e)
    # 6 foreach ops, the ``tbig * 2`` they read rows of and 2 reads of those rows.
    assert counted[-1] == {"fused_ops": 9, "fused_segments": 1}


def test_recorded_inplace_foreach_writes_views_too():
    # Whole tensors take their pending values; views of other tensors are written as a
    # recorded in-place single op's are: the segment runs, and every value is kept.
    g = torch.Generator().manual_seed(0)
    u, v, w = (torch.randn(3, 64, generator=g) for _ in range(3))
    others = [torch.randn(64, generator=g) for _ in range(3)]
    want = [u.clone(), v.clone(), w.clone()]
    torch._foreach_add_([want[0][1], want[1], want[2][2]], others, alpha=0.5)
    tu, tv, tw = (t.to(TPU) for t in (u, v, w))
    with torchjax.fused():
        tu, tv, tw = tu * 1, tv * 1, tw * 1  # recorded values
        torch._foreach_add_([tu[1], tv, tw[2]], [o.to(TPU) for o in others], alpha=0.5)
    for got, w_ in zip((tu, tv, tw), want, strict=True):
        assert torch.equal(got.cpu(), w_)


@pytest.mark.parametrize("which", [0, 1], ids=["own-element", "other-element"])
def test_an_in_place_call_whose_scalar_tensor_views_an_element_raises_as_cpu(which):
    # ``_foreach_mul_(lead, lead[k][0])``: CPU multiplies element by element and refuses
    # the element whose memory the scalar is in; one program over the list read the
    # scalar once and wrote every element.
    errors = []
    for dev in ("cpu", TPU):
        lead = [torch.tensor([2.0, 3.0]).to(dev), torch.tensor([1.0, 1.0]).to(dev)]
        with pytest.raises(RuntimeError, match="single memory location") as e:
            torch._foreach_mul_(lead, lead[which][0])
        errors.append(str(e.value).split(" (in aten")[0])
    assert errors[0] == errors[1]
