"""Captured module calls that need an autograd graph (Note [Captured calls that need a
graph] in torchjax/compile/_captured.py): the forward one program, ``backward()`` one
program, eager's bits and eager's autograd semantics."""

import warnings

import pytest
import torch

import torchjax
from tests._models import IDS, tiny_llama
from tests.compile._capture_stats import capture_counts
from torchjax.compile import _autograd

TPU = "tpu"

pytestmark = pytest.mark.usefixtures("fresh_executables")


@pytest.fixture
def backward_programs(monkeypatch):
    """How many times a compiled backward program of a captured call ran."""
    runs = [0]
    call = _autograd.Backward.__call__

    def counted(self, *args):
        runs[0] += self.nodes
        return call(self, *args)

    monkeypatch.setattr(_autograd.Backward, "__call__", counted)
    return runs


def _fused_ops():
    return torchjax.stats()["fused_ops"]


def _llama_steps(dtype, mode, steps, backward_programs=None):
    """``steps`` AdamW train steps of the tiny Llama in ``mode`` ("eager": plain eager;
    "fused": fused eager, nothing captured; "capture": fused eager, capture on): the
    losses, grads and parameters after each step, and per step (captured calls, traces,
    refusals, ops recorded by the forward and backward, backward programs run)."""
    model = tiny_llama().to(TPU).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ids = IDS.to(TPU)
    results, counts = [], []
    torchjax.reset_stats()
    for _ in range(steps):
        with torchjax.fused(mode != "eager", capture=mode == "capture"):
            ops = _fused_ops()
            runs = backward_programs[0] if backward_programs else 0
            loss = model(ids, labels=ids).loss
            loss.backward()
            ops = _fused_ops() - ops
            runs = (backward_programs[0] if backward_programs else 0) - runs
            grads = [p.grad.cpu() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        params = [p.detach().cpu() for p in model.parameters()]
        results.append((loss.detach().cpu(), grads, params))
        counts.append((*capture_counts(), ops, runs))
    return results, counts


def _assert_equal_steps(got, want):
    assert len(got) == len(want) > 0
    for (loss, grads, params), (wloss, wgrads, wparams) in zip(got, want):
        assert torch.equal(loss, wloss)
        assert len(grads) == len(wgrads) > 0
        for g, w in zip(grads, wgrads):
            assert torch.equal(g, w)
        for p, w in zip(params, wparams):
            assert torch.equal(p, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_train_steps_are_captured_with_eagers_bits(dtype, backward_programs):
    want, _ = _llama_steps(dtype, "eager", 4)
    got, counts = _llama_steps(dtype, "capture", 4, backward_programs)
    _assert_equal_steps(got, want)
    # Step 1 op by op (its forward and backward recorded), step 2 traced and run, then
    # the programs alone: no op of the forward or the backward recorded, one backward
    # program per step.
    assert counts[0][:3] == (0, 0, 0) and counts[0][3] > 100 and counts[0][4] == 0
    assert counts[1] == (1, 1, 0, 0, 1)
    assert counts[3] == (3, 1, 0, 0, 1)


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    ).to(dtype)


def _mlp_steps(dtype, mode, opt_class, steps=4):
    model = _mlp(dtype).to(TPU)
    opt = opt_class(model.parameters())
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    out = []
    torchjax.reset_stats()
    for x in xs:
        with torchjax.fused(mode != "eager", capture=mode == "capture"):
            loss = model(x.to(TPU).to(dtype)).pow(2).mean()
            loss.backward()
            grads = [p.grad.cpu() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        out.append((loss.detach().cpu(), grads, [p.detach().cpu() for p in model.parameters()]))
    return out, capture_counts()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "opt_class",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    ],
    ids=["sgd", "adamw"],
)
def test_small_module_train_steps_give_eagers_bits(dtype, opt_class):
    want, _ = _mlp_steps(dtype, "eager", opt_class)
    got, counts = _mlp_steps(dtype, "capture", opt_class)
    _assert_equal_steps(got, want)
    assert counts == (3, 1, 0)


def _linear():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))


def _both(step, calls=3):
    """``step(model, i)`` for ``i < calls`` in plain eager and with capture on, each on
    a fresh tpu copy of the same model: (eager's results, captured results, capture
    counts)."""
    out = []
    for capture in (False, True):
        model = _linear().to(TPU)
        torchjax.reset_stats()
        with torchjax.fused(capture):
            results = [step(model, i) for i in range(calls)]
        out.append(results)
    return out[0], out[1], capture_counts()


def _leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


def _assert_same(got, want):
    leaves_got, leaves_want = _leaves(got), _leaves(want)
    assert len(leaves_got) == len(leaves_want) > 0
    for g, w in zip(leaves_got, leaves_want):
        if isinstance(w, torch.Tensor):
            assert torch.equal(g.cpu(), w.cpu())
        else:
            assert g == w


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_hooks_on_parameters_run_once_per_backward():
    def step(model, i):
        if i == 0:
            model.calls = []
            model[0].weight.register_hook(lambda g: model.calls.append("pre") or g * 2)
            model[2].weight.register_post_accumulate_grad_hook(lambda p: model.calls.append("post"))
        model(X.to(TPU)).sum().backward()
        return len(model.calls), _grads(model)

    want, got, counts = _both(step)
    assert counts == (2, 1, 0)
    assert [n for n, _ in got] == [2, 4, 6]
    _assert_same(got, want)


def test_retain_graph_and_a_second_backward_as_eager():
    def step(model, i):
        loss = model(X.to(TPU)).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return _grads(model)

    want, got, counts = _both(step)
    assert counts == (2, 1, 0)
    _assert_same(got, want)

    model = _linear().to(TPU)
    with torchjax.fused():
        for _ in range(2):
            model(X.to(TPU)).sum().backward()
        torchjax.reset_stats()
        loss = model(X.to(TPU)).pow(2).sum()
        loss.backward()
        assert capture_counts() == (1, 0, 0)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


@pytest.mark.parametrize("leaf", [True, False])
def test_tensor_arguments_requiring_grad_get_eagers_grads(leaf):
    def step(model, i):
        x = X.to(TPU).requires_grad_()
        model(x if leaf else x * 2).pow(2).sum().backward()
        return x.grad, _grads(model)

    want, got, counts = _both(step)
    assert counts == (2, 1, 0)
    _assert_same(got, want)


def test_a_parameter_written_in_place_before_backward_raises_as_in_eager():
    for capture in (False, True):
        model = _linear().to(TPU)
        torchjax.reset_stats()
        with torchjax.fused(capture):
            for _ in range(2):
                model(X.to(TPU)).sum().backward()
            loss = model(X.to(TPU)).sum()
            with torch.no_grad():
                model[2].weight.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
        assert capture_counts() == ((2, 1, 0) if capture else (0, 0, 0))


def test_gradients_of_two_forwards_accumulate_as_in_eager():
    def one_backward(model, i):
        a = model(X.to(TPU)).pow(2).sum()
        b = model(X.to(TPU) * 3).pow(2).sum()
        (a + b).backward()
        return _grads(model)

    def two_backwards(model, i):
        model(X.to(TPU)).pow(2).sum().backward()
        model(X.to(TPU) * 3).pow(2).sum().backward()
        return _grads(model)

    for step in (one_backward, two_backwards):
        want, got, counts = _both(step)
        assert counts == (5, 1, 0)  # one signature: first call op by op, then captured
        _assert_same(got, want)


def test_frozen_parameters_are_part_of_the_signature():
    def step(model, i):
        model[0].requires_grad_(i >= 3)
        model(X.to(TPU)).pow(2).sum().backward()
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    want, got, counts = _both(step, calls=6)
    # Three calls frozen (op by op, traced, run), then three with every parameter
    # training: a new signature, op by op once, then traced.
    assert counts == (4, 2, 0)
    assert got[2][0] is None and got[3][0] is not None
    _assert_same(
        [[g for g in r if g is not None] for r in got],
        [[g for g in r if g is not None] for r in want],
    )


def _penalty(model, x):
    loss = model(x).pow(2).sum()
    (g,) = torch.autograd.grad(loss, [model[0].weight], create_graph=True)
    (loss + g.pow(2).sum()).backward()
    return g.detach(), _grads(model)


def test_a_call_differentiated_with_create_graph_is_not_captured():
    # Note [Double backward of a captured call]: the op by op first call's backward
    # asked for a graph, so the signature is refused and runs op by op: eager's bits.
    want, got, counts = _both(lambda model, i: _penalty(model, X.to(TPU)))
    assert counts == (0, 0, 1)
    assert torchjax.stats()["capture_refusal_reasons"] == {
        "Sequential": "Sequential: its backward was asked for a graph (create_graph=True)"
    }
    _assert_same(got, want)


def test_create_graph_through_a_captured_call_runs_it_again_op_by_op():
    def step(model, i):
        if i < 2:
            model(X.to(TPU)).pow(2).sum().backward()
            return _grads(model)
        return _penalty(model, X.to(TPU))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got, counts = _both(step, calls=4)
    said = [str(w.message) for w in caught if "create_graph=True" in str(w.message)]
    assert len(said) == 1 and "ran again op by op" in said[0]
    # The second and third calls were captured; the third's backward with a graph
    # refused the signature, so the fourth ran op by op.
    assert counts == (2, 1, 1)
    _assert_same(got[:2], want[:2])
    for g, w in zip(_leaves(got), _leaves(want)):
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-6)


class _KeepOnCtx(torch.autograd.Function):
    """An intermediate kept on ctx: the graph cannot be replayed outside its forward."""

    @staticmethod
    def forward(ctx, a):
        y = a.exp()
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.y


class _Kept(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear()

    def forward(self, x):
        return _KeepOnCtx.apply(self.lin(x))


def test_a_backward_torchs_graph_cannot_give_as_nodes_is_refused():
    grads = []
    for capture in (False, True):
        model = _Kept().to(TPU)
        torchjax.reset_stats()
        with torchjax.fused(capture):
            for _ in range(3):
                model(X.to(TPU)).sum().backward()
        grads.append(_grads(model))
        # torchjax.jit's VJP would be jax.vjp of the forward: refused, op by op.
        assert capture_counts() == ((0, 0, 1) if capture else (0, 0, 0))
        reasons = torchjax.stats()["capture_refusal_reasons"]
        assert list(reasons) == (["_Kept"] if capture else [])
    # The reason names what the graph met: ctx.y, a value of the forward trace.
    assert reasons["_Kept"] == (
        "TraceError: _Kept: a captured call's backward cannot be built from torch's autograd "
        "graph as fused eager's nodes (a value of the forward trace reached its backward as "
        "a constant); it runs op by op"
    )
    _assert_same(grads[1], grads[0])


def test_calls_under_saved_tensors_hooks_run_op_by_op():
    def step(model, i):
        with torch.autograd.graph.save_on_cpu():
            loss = model(X.to(TPU)).pow(2).sum()
        loss.backward()
        return _grads(model)

    want, got, counts = _both(step)
    assert counts == (0, 0, 0)
    _assert_same(got, want)
