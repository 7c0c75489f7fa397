"""Note [Fills of storages made inside a trace] (torchjax/tensor/_fills.py): tensors a
compiled function makes and reads are computed in its program, not captured as
constants of it, and none of them outlives the trace as a tracer."""

import contextlib
import copy
import warnings

import jax
import torch

import torchjax

BIG = 1 << 20  # bytes: above the size small fills take from the host


@contextlib.contextmanager
def _no_constants_captured(limit=64 * 1024):
    """Fails if a program lowered in the block captured more than ``limit`` bytes of
    constants (JAX warns when it lowers one)."""
    old = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", limit)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", old)
    captured = [str(w.message)[:300] for w in seen if "constants were captured" in str(w.message)]
    assert not captured, captured


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(1024, 256),
        torch.nn.Linear(256, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 1024),
    )


def test_a_training_step_captures_no_state_or_gradient_zeros_and_matches_cpu():
    # AdamW makes its moments with zeros_like in the first call; an embedding's backward
    # scatters into zeros of the table's size: each was a 0.5-1 MB constant before.
    cpu = _model()
    tpu = copy.deepcopy(cpu).to("tpu")
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.01)
    opt = torch.optim.AdamW(tpu.parameters(), lr=1e-2, weight_decay=0.01)

    def step(model, opt, ids):
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    @torchjax.jit
    def run(ids):
        return step(tpu, opt, ids)

    ids = torch.randint(0, 1024, (4, 16))
    for _ in range(3):
        want = step(cpu, opt_cpu, ids)
        with _no_constants_captured():
            got = run(ids.to("tpu"))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert run.trace_count == 2  # the first call creates AdamW's state
    for (name, p), q in zip(cpu.named_parameters(), tpu.parameters()):
        # Adam divides by sqrt(v): float32 rounding of near-zero gradients reaches 1e-4 of lr
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-4, msg=name)
    state = opt.state[tpu[0].weight]
    assert not isinstance(torchjax.to_jax(state["exp_avg"]), jax.core.Tracer)
    torch.testing.assert_close(state["exp_avg"].cpu(), opt_cpu.state[cpu[0].weight]["exp_avg"])


def test_zeros_made_and_read_inside_are_computed_in_the_program():
    n = BIG // 4 * 2

    @torchjax.jit
    def f(x):
        z = torch.zeros(n, device="tpu")
        return (z + x).sum(), torch.ones(n, device="tpu").mul(x).sum()

    with _no_constants_captured(limit=1024):
        a, b = f(torch.tensor(2.0, device="tpu"))
    assert (a.item(), b.item()) == (2.0 * n, 2.0 * n)


class _Holder:
    pass


def test_a_tensor_made_inside_and_kept_where_the_state_walk_cannot_see_holds_its_fill():
    # Read inside the trace, never written: after the call it is unmade zeros again,
    # not the trace's tracer, and eager code reads it.
    holder = _Holder()

    @torchjax.jit
    def f(x):
        holder.kept = torch.zeros(BIG // 4, device="tpu")
        holder.view = holder.kept[:8]
        return x + holder.kept[:3]

    out = f(torch.ones(3, device="tpu"))
    assert out.cpu().tolist() == [1.0, 1.0, 1.0]
    for t in (holder.kept, holder.view):
        assert not isinstance(torchjax.to_jax(t), jax.core.Tracer)
    assert holder.kept.sum().item() == 0.0 and holder.view.cpu().tolist() == [0.0] * 8
    holder.kept.add_(1)
    assert holder.view.cpu().tolist() == [1.0] * 8


def test_a_buffer_made_inside_and_never_written_stays_zeros_in_later_calls():
    module = torch.nn.Module()

    @torchjax.jit
    def f(x):
        if not hasattr(module, "acc"):
            module.register_buffer("acc", torch.zeros(BIG // 4, device="tpu"))
        return x * 2 + module.acc[:2]

    x = torch.ones(2, device="tpu")
    for _ in range(3):
        assert f(x).cpu().tolist() == [2.0, 2.0]
    assert module.acc.sum().item() == 0.0


def test_a_buffer_made_inside_and_written_is_the_programs_output():
    module = torch.nn.Module()

    @torchjax.jit
    def f(x):
        if not hasattr(module, "count"):
            module.register_buffer("count", torch.zeros(BIG // 4, device="tpu"))
        module.count.add_(x)
        return module.count[:2] * 1

    x = torch.tensor(1.5, device="tpu")
    assert f(x).cpu().tolist() == [1.5, 1.5]
    assert f(x).cpu().tolist() == [3.0, 3.0]
    assert module.count[-1].item() == 3.0


def test_a_compiled_backward_captures_no_zeros():
    # A jitted forward differentiated outside: its backward program (an embedding's
    # gradient scatters into zeros of the table) is traced with the same rule.
    torch.manual_seed(0)
    emb_cpu = torch.nn.Embedding(4096, 64)
    emb = copy.deepcopy(emb_cpu).to("tpu")
    f = torchjax.jit(lambda ids: emb(ids).square().sum())
    ids = torch.randint(0, 4096, (32,))
    with _no_constants_captured():
        f(ids.to("tpu")).backward()
    emb_cpu(ids).square().sum().backward()
    torch.testing.assert_close(emb.weight.grad.cpu(), emb_cpu.weight.grad)
