"""Captured optimizer steps (Note [Captured optimizer steps] in
torchjax/compile/_captured_optim.py): a repeated ``opt.step()`` in fused eager mode is
one program, eager's bits, no program made per step, and every way out of it eager's."""

import threading

import jax
import pytest
import torch
from torch.optim import optimizer as torch_optimizer

import torchjax
from tests._models import IDS, tiny_llama
from torchjax._compat.torch_optim import _HOOKS_NAME
from torchjax.compile import _captured_optim, _step_tape

TPU = "tpu"
optim = torch.optim

pytestmark = pytest.mark.usefixtures("fresh_executables")


def _counts():
    s = torchjax.stats()
    return {
        k: s[k]
        for k in ("captured_steps", "captured_step_refusals", "fused_ops", "compiles")
        + ("persistent_cache_hits", "fused_segments")
    }


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}


def _assert_same(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert len(g) == len(w) > 0
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _llama_steps(dtype, mode, steps):
    """AdamW steps of the tiny Llama (``mode``: "eager", or "capture": fused eager with
    captured calls): per step the loss, every grad and every parameter after it, and
    the counters of the step's ``opt.step()``."""
    model = tiny_llama().to(TPU).to(dtype).train()
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ids = IDS.to(TPU)
    out, counts = [], []
    torchjax.reset_stats()
    for _ in range(steps):
        with torchjax.fused(mode != "eager"):
            loss = model(ids, labels=ids).loss
            loss.backward()
            grads = [p.grad.cpu() for p in model.parameters()]
            before = _counts()
            opt.step()
            counts.append(_delta(_counts(), before))
            opt.zero_grad()
        out.append([loss.detach().cpu(), *grads, *(p.detach().cpu() for p in model.parameters())])
    return out, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_adamw_step_is_one_program_with_eagers_bits(dtype):
    want, _ = _llama_steps(dtype, "eager", 6)
    got, counts = _llama_steps(dtype, "capture", 6)
    _assert_same(got, want)
    # Step 1 creates the state (recorded); step 2 is recorded, learned and run as the
    # learned program (compiled then), not as a segment; then that program alone:
    # nothing recorded, no segment, nothing compiled.
    assert [c["captured_steps"] for c in counts] == [0, 1, 1, 1, 1, 1]
    assert counts[1]["fused_ops"] > 0 and counts[1]["fused_segments"] == 0
    for c in counts[2:]:
        assert c["fused_ops"] == c["fused_segments"] == c["captured_step_refusals"] == 0
        assert c["compiles"] == c["persistent_cache_hits"] == 0


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    ).to(dtype)


def _mlp_steps(dtype, fused, make, steps=5, each=None):
    """``steps`` train steps of a small MLP with ``make(params)``'s optimizer, in plain
    eager or fused eager (captured calls on): per step the loss and the parameters, and
    the counters over all steps. ``each(opt, i)`` runs before step ``i``."""
    model = _mlp(dtype).to(TPU)
    opt = make(model.parameters())
    out = []
    torchjax.reset_stats()
    for i in range(steps):
        if each is not None:
            each(opt, i)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        with torchjax.fused(fused):
            loss = model(x.to(TPU).to(dtype)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out.append([loss.detach().cpu(), *(p.detach().cpu() for p in model.parameters())])
    return out, _counts()


_OPTIMIZERS = {
    "adam": lambda ps: optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad_maximize": lambda ps: optim.Adam(
        ps, lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.1
    ),
    "sgd": lambda ps: optim.SGD(ps, lr=0.1),
    "sgd_nesterov": lambda ps: optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adagrad": lambda ps: optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "nadam": lambda ps: optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: optim.RAdam(ps, lr=0.01),
    "adamax": lambda ps: optim.Adamax(ps, lr=0.01),
    "adadelta": lambda ps: optim.Adadelta(ps),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_optimizer_steps_are_captured_with_eagers_bits(name, dtype):
    make = _OPTIMIZERS[name]
    want, _ = _mlp_steps(dtype, False, make)
    got, counts = _mlp_steps(dtype, True, make)
    _assert_same(got, want)
    # The first step is recorded (it creates the state; for SGD, which keeps none, the
    # op by op backward left bias gradients as views), the second learned.
    assert counts["captured_steps"] == 4
    assert counts["captured_step_refusals"] == 0


def test_a_step_reading_tpu_values_on_the_host_is_not_captured():
    # ASGD keeps eta and mu as tpu tensors and reads them with .item(): another op in
    # the step, so its steps run as fused mode runs them.
    make = lambda ps: optim.ASGD(ps, lr=0.01)  # noqa: E731
    want, _ = _mlp_steps(torch.float32, False, make)
    got, counts = _mlp_steps(torch.float32, True, make)
    _assert_same(got, want)
    assert counts["captured_steps"] == counts["captured_step_refusals"] == 0


def test_a_learning_rate_schedule_changes_inputs_not_programs():
    def lr(opt, i):
        for g in opt.param_groups:
            g["lr"] = 1e-2 / (1 + i)

    make = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
    want, _ = _mlp_steps(torch.bfloat16, False, make, steps=7, each=lr)
    torchjax.reset_stats()
    got, counts = _mlp_steps(torch.bfloat16, True, make, steps=7, each=lr)
    _assert_same(got, want)
    assert counts["captured_steps"] == 6 and counts["captured_step_refusals"] == 0


def test_compiles_stay_flat_under_a_schedule():
    model = _mlp(torch.float32).to(TPU)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    sched = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    made = []  # programs compiled (or loaded from the persistent cache) per step
    torchjax.reset_stats()
    for i in range(8):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(TPU)
        before = _counts()
        with torchjax.fused():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        sched.step()
        d = _delta(_counts(), before)
        made.append(d["compiles"] + d["persistent_cache_hits"])
    assert made[2:] == [0] * 6
    assert torchjax.stats()["captured_steps"] == 7


class _Scaled(optim.Optimizer):
    """``p *= lr; p += lr`` per parameter group, with a failure or a kept temporary on
    request: the ways out of a replayed step."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.fail = self.keep = False
        self.kept = None

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            ps = group["params"]
            torch._foreach_mul_(ps, group["lr"])
            if self.fail:
                raise RuntimeError("a failure inside the step")
            doubled = torch._foreach_add(ps, ps)
            if self.keep:
                self.kept = doubled
            torch._foreach_add_(ps, doubled, alpha=group["lr"])


def _scaled_steps(fused, on_step):
    torch.manual_seed(0)
    ps = [torch.randn(4, 3).to(TPU), torch.randn(5).to(TPU)]
    opt = _Scaled(ps, lr=0.5)
    out = []
    torchjax.reset_stats()
    for i in range(6):
        with torchjax.fused(fused):
            for p in ps:
                p.grad = torch.ones_like(p)
            on_step(opt, i)
            try:
                opt.step()
            except RuntimeError:
                pass
            opt.fail = False
            kept = [t.cpu() for t in opt.kept] if opt.kept else []
        out.append([p.cpu() for p in ps] + kept)
    return out, _counts()


def _fail_at_4(opt, i):
    opt.fail = i == 4


def _keep_from_4(opt, i):
    opt.keep = i >= 4


def _post_hook_from_4(opt, i):
    if i == 4:
        opt.register_step_post_hook(
            lambda o, a, k: [p.mul_(2) for p in o.param_groups[0]["params"]]
        )


@pytest.mark.parametrize("on_step", [_fail_at_4, _keep_from_4, _post_hook_from_4])
def test_a_replayed_step_that_does_something_else_gives_eagers_values(on_step):
    # A step that raises after its first call (that call's write is seen, as in eager),
    # one whose temporary outlives it, one whose own post-hook runs an op: the calls
    # taped so far run as recorded calls, and the signature is refused.
    want, _ = _scaled_steps(False, on_step)
    got, counts = _scaled_steps(True, on_step)
    _assert_same(got, want)
    assert counts["captured_steps"] == 4  # steps 0 (learned) to 3
    assert counts["captured_step_refusals"] == 1


def test_a_read_from_another_thread_runs_the_step_first():
    # The optimizer's own post-hook reads a parameter from another thread while the
    # step's writes are deferred: the calls taped so far run there (under the step's
    # lock), the read sees them, and the signature is refused.
    seen = []

    def read_in_thread(opt, i):
        if i != 4:
            return
        p = opt.param_groups[0]["params"][0]

        def hook(o, a, k):
            worker = threading.Thread(target=lambda: seen.append(p.cpu()))
            worker.start()
            worker.join()

        opt.register_step_post_hook(hook)

    want, _ = _scaled_steps(False, lambda opt, i: None)
    got, counts = _scaled_steps(True, read_in_thread)
    assert len(seen) == 2  # steps 4 and 5
    assert torch.equal(seen[0], want[4][0]) and torch.equal(seen[1], want[5][0])
    _assert_same(got, want)
    assert counts["captured_steps"] == 4  # steps 0 (learned) to 3
    assert counts["captured_step_refusals"] == 1


def test_a_step_with_a_closure_is_not_captured():
    model = _mlp(torch.float32).to(TPU)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 6).to(TPU)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    torchjax.reset_stats()
    with torchjax.fused():
        for _ in range(4):
            opt.step(closure)
    assert torchjax.stats()["captured_steps"] == 0


def test_the_hooks_are_registered_only_while_fused_mode_is_on():
    hooks = torch_optimizer._global_optimizer_pre_hooks
    names = lambda: {p.name for p in torchjax.patches()}  # noqa: E731
    assert _HOOKS_NAME not in names() and len(hooks) == 0
    with torchjax.fused():
        assert _HOOKS_NAME in names() and len(hooks) == 1
    assert _HOOKS_NAME not in names() and len(hooks) == 0


def _learned(opt):
    (learned,) = _captured_optim._CAPTURES[opt].entries.values()
    return learned


def test_a_replayed_step_donates_what_it_writes_and_nothing_held_elsewhere():
    # The parameters and both moments are written in place: their old arrays are dead
    # and donated (Note [Fused segments donate their dead inputs]), except one the user
    # still holds, which keeps its values.
    make = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
    held = {}

    def hold(opt, i):
        if i == 3:
            p = opt.param_groups[0]["params"][0]
            held["old"] = (torchjax.to_jax(p), p.detach().cpu())
            held["opt"] = opt

    want, _ = _mlp_steps(torch.float32, False, make)
    got, counts = _mlp_steps(torch.float32, True, make, each=hold)
    _assert_same(got, want)
    assert counts["captured_steps"] == 4
    learned = _learned(held["opt"])
    assert len(learned.donatable) == 18  # 6 parameters and 2 moments each
    assert learned.donatable in learned.jitted  # every one donated
    assert len(learned.jitted) == 2  # and all but the held one, at step 3
    arr, values = held["old"]
    assert not arr.is_deleted() and torch.equal(torch.from_numpy(jax.device_get(arr)), values)


@pytest.mark.parametrize("fails_from", [1, 2], ids=["learned", "replayed"])
def test_a_step_out_of_device_memory_runs_as_recorded_calls(monkeypatch, fails_from):
    # The learned program does not fit (at the learned step, or at the first replayed
    # one): the step runs as fused mode runs it, with eager's values, and its signature
    # is refused.
    program = _step_tape.Learned.program
    calls = []

    def failing(self, donated):
        real = program(self, donated)

        def run(*args):
            calls.append(1)
            if len(calls) >= fails_from:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory")
            return real(*args)

        return run

    monkeypatch.setattr(_step_tape.Learned, "program", failing)
    make = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
    want, _ = _mlp_steps(torch.bfloat16, False, make)
    got, counts = _mlp_steps(torch.bfloat16, True, make)
    _assert_same(got, want)
    assert len(calls) == fails_from
    assert counts["captured_steps"] == fails_from - 1
    # A learned step whose program does not fit is never stored: no refusal counted.
    assert counts["captured_step_refusals"] == fails_from - 1


def test_a_replayed_step_updates_its_lists_in_place(monkeypatch):
    # The program's outputs are ordered as its donated inputs, so each parameter and
    # moment aliases its own new value (jax pairs a donated input with the first output
    # of its shape and dtype left): beside its arguments the program holds the
    # denominators (sqrt's list and the division's), no copies of the state.
    seen = []
    program = _step_tape.Learned.program

    def recording(self, donated):
        real = program(self, donated)

        def run(*args):
            seen.append((real, args, donated))
            return real(*args)

        return run

    monkeypatch.setattr(_step_tape.Learned, "program", recording)
    n, size = 6, 1 << 14

    def steps(fused):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(size, dtype=torch.bfloat16).to(TPU)) for _ in range(n)]
        opt = optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
        for step in range(5):
            torch.manual_seed(step)
            for p in ps:
                p.grad = torch.randn(size, dtype=torch.bfloat16).to(TPU)
            with torchjax.fused(fused):
                opt.step()
            torch.tpu.synchronize()
        return [[p.detach().cpu() for p in ps]]

    want = steps(False)
    _assert_same(steps(True), want)
    assert seen
    lists = n * size * 2
    for real, args, donated in seen:
        assert len(donated) == 3 * n
        memory = real.lower(*args).compile().memory_analysis()
        assert memory.alias_size_in_bytes == 3 * lists
        assert memory.temp_size_in_bytes <= 2 * lists + 4096
