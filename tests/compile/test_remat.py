"""Activation checkpointing inside torchjax.jit programs (Note [Checkpointed regions in
compiled programs] in torchjax/compile/_remat.py): the region is recomputed in the
program instead of merged with its forward, and the gradients stay CPU's."""

import copy
import re

import jax
import pytest
import torch
from jax.extend.core import jaxpr_as_fun
from torch.utils.checkpoint import checkpoint

import torchjax

H, S, BLOCKS = 16, 32, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(H, 2 * H)
        self.b = torch.nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)).sin())


class Stack(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            # The first block's input does not require grad: a reentrant checkpoint
            # there would leave no graph (as on CPU).
            if self.mode == "none" or i == 0:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def _train(mode, device, steps=2):
    torch.manual_seed(0)
    model = Stack(mode).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(S, H).to(device)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = torchjax.jit(step) if device == "tpu" else step
    losses = [run(x).item() for _ in range(steps)]
    params = [p.detach().cpu() for p in model.parameters()]
    return losses, params, run


def _optimized_sines(jitted) -> int:
    """How many sines the step's optimized program computes."""
    (entry,) = jitted._entries.values()
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in entry.closed.jaxpr.invars]
    text = jax.jit(jaxpr_as_fun(entry.closed)).lower(*avals).compile().as_text()
    return len(re.findall(r" sine\(", text))


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpointed_step_matches_cpu(mode):
    cpu_losses, cpu_params, _ = _train(mode, "cpu")
    losses, params, jitted = _train(mode, "tpu")
    assert jitted.trace_count == 1
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-6)
    assert len(params) == 4 * BLOCKS
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpointed_regions_are_recomputed_not_merged(mode):
    # Without the barrier XLA merged each recomputed sine with its forward twin: the
    # checkpointed program computed as many sines as the plain one.
    _, _, plain = _train("none", "tpu", steps=1)
    _, _, checkpointed = _train(mode, "tpu", steps=1)
    assert _optimized_sines(checkpointed) >= _optimized_sines(plain) + (BLOCKS - 1)


def _barrier_dependencies(jitted) -> list[set]:
    """For each optimization barrier of the step's program, in program order, the
    earlier barriers its operands depend on."""
    (entry,) = jitted._entries.values()
    deps, barriers = {}, []
    for eqn in entry.closed.jaxpr.eqns:
        d = set().union(*(deps.get(v, set()) for v in eqn.invars if not hasattr(v, "val")))
        if eqn.primitive.name == "optimization_barrier":
            barriers.append(set(d))
            d.add(len(barriers) - 1)
        for v in eqn.outvars:
            deps[v] = d
    return barriers


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_each_recomputation_waits_for_the_backward_of_the_region_after_it(mode):
    # A recomputation whose barrier reads forward values only may run anywhere after
    # the forward: XLA's TPU scheduler ran them all there, every region's activations
    # live at once. Each barrier reads the backward's newest values, so the
    # recomputation of a region waits for the one after it.
    _, _, jitted = _train(mode, "tpu", steps=1)
    barriers = _barrier_dependencies(jitted)
    assert len(barriers) == BLOCKS - 1  # the first block is not checkpointed
    for i, earlier in enumerate(barriers):
        assert earlier == set(range(i)), (i, earlier)


def test_eager_checkpoint_inputs_pass_unchanged():
    from torchjax.compile._remat import barrier

    x = torch.ones(3, device="tpu", requires_grad=True)
    values = [x, 2, None]
    assert barrier(values, connected=True) is values


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_replays_its_mask_in_a_jitted_step(reentrant):
    # The recomputation drew new keys inside the trace: the backward's mask was another
    # one than the forward's (Note [RNG states inside a trace] in torchjax/tensor/random.py).
    def step(x):
        y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5), x, use_reentrant=reentrant)
        y.sum().backward()
        return y.detach()

    torch.manual_seed(0)
    x = torch.ones(1000, device="tpu", requires_grad=True)
    y = torchjax.jit(step)(x)
    kept, grad = y.cpu() != 0, x.grad.cpu()
    assert 300 < int(kept.sum()) < 700
    assert torch.equal(grad != 0, kept)
    torch.testing.assert_close(grad[kept], torch.full((int(kept.sum()),), 2.0))


def test_rng_state_inside_a_trace_is_the_streams_position():
    from torchjax.tensor import random as tjr

    def fn(x):
        state = torch.tpu.get_rng_state()
        a = torch.rand(3, device="tpu")
        torch.tpu.set_rng_state(state)
        b = torch.rand(3, device="tpu")
        return a + x, b + x

    a, b = torchjax.jit(fn)(torch.zeros(3, device="tpu"))
    assert torch.equal(a.cpu(), b.cpu())
    # Outside a trace the state is the device's (seed, counter).
    torch.manual_seed(3)
    seed, _ = tjr.get_state().numpy().view("uint64").tolist()
    assert seed == 3


def _weighted(x, w):
    return (x * w).sin() * w


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_inputs_with_and_without_grad_matches_cpu(reentrant):
    # One region input requires grad, the other not: the recomputation's inputs keep
    # that split, or the product saves both operands where the forward saved one and
    # torch's checkpoint refuses the recomputation.
    def step(x, w):
        y = checkpoint(_weighted, x, w, use_reentrant=reentrant)
        y.sum().backward()
        return y.detach()

    torch.manual_seed(0)
    x, w = torch.randn(8), torch.randn(8)
    cpu_w = w.clone().requires_grad_()
    want = step(x, cpu_w)
    tpu_w = w.to("tpu").requires_grad_()
    got = torchjax.jit(step)(x.to("tpu"), tpu_w)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(tpu_w.grad.cpu(), cpu_w.grad)


def test_torch_compile_of_checkpointed_blocks_matches_cpu():
    # Under Dynamo the blocks' parameters are inputs of the checkpointed region beside
    # an activation; the first block's input requires no grad.
    def train(device, compiler):
        torch.manual_seed(0)
        model = Stack("none").to(device)  # its blocks; the step checkpoints every one
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(S, H).to(device)

        def step(x):
            h = x
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            loss = h.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        run = compiler(step)
        losses = [run(x).item() for _ in range(2)]
        return losses, [p.detach().cpu() for p in model.parameters()]

    want, want_params = train("cpu", lambda f: f)
    got, got_params = train("tpu", lambda f: torch.compile(f, backend="tpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(got_params) == 4 * BLOCKS
    for g, w in zip(got_params, want_params):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class _Scaled(torch.nn.Module):
    def __init__(self, scale, p, reentrant):
        super().__init__()
        self.lin, self.scale, self.p, self.reentrant = torch.nn.Linear(4, 4), scale, p, reentrant

    def region(self, h):
        h = torch.nn.functional.dropout(h, self.p, training=self.p > 0)
        return torch.tanh(self.lin(h) * self.scale)

    def forward(self, x):
        return checkpoint(self.region, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_compile_of_a_region_reading_a_changing_float_matches_cpu(reentrant):
    # A float attribute that changed between calls comes back from Dynamo as a 0-d CPU
    # tensor input whose .item() is inside the checkpointed region's subgraph: that read
    # was not seen, and the trace refused the value (Note [Python floats Dynamo passes
    # as tensors]).
    results = 0
    for scale, p in ((0.5, 0.0), (1.5, 0.0), (2.5, 0.0)):
        torch.manual_seed(0)
        cpu = _Scaled(scale, p, reentrant)
        tpu = copy.deepcopy(cpu).to("tpu")
        x = torch.randn(8, 4, requires_grad=True)
        xt = x.detach().to("tpu").requires_grad_()
        cpu(x).sum().backward()
        torch.compile(tpu, backend="tpu")(xt).sum().backward()
        torch.testing.assert_close(xt.grad.cpu(), x.grad)
        torch.testing.assert_close(tpu.lin.weight.grad.cpu(), cpu.lin.weight.grad)
        results += 1
    assert results == 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_compile_of_a_region_with_a_changing_dropout_rate(reentrant):
    # The rate reaches the region as the float above; each call drops at its own rate:
    # a row of x's gradient is zero where all four of its inputs were dropped (p ** 4).
    torch.manual_seed(0)
    zero_rows = []
    for p in (0.2, 0.6):
        m = _Scaled(1.0, p, reentrant).to("tpu")
        x = torch.ones(4000, 4, device="tpu", requires_grad=True)
        torch.compile(m, backend="tpu")(x).sum().backward()
        zero_rows.append(float((x.grad == 0).all(1).float().mean()))
    assert zero_rows[0] < 0.01
    assert 0.10 < zero_rows[1] < 0.16  # 0.6 ** 4 = 0.13
