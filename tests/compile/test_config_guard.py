"""A module's ``config`` is part of a compiled call's key (Note [A module's config is a
guard] in torchjax/compile/_state.py): switching a transformers model's experts or
attention implementation after a compiled call runs the new code, as CPU does, in
``torchjax.jit`` and in the automatically compiled ``generate``; an unchanged config
reuses the program."""

import copy
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

import torchjax  # noqa: E402
from tests.integrations import tiny_models  # noqa: E402


def _scaled_experts(self, hidden, index, weights):
    """transformers' grouped_mm experts, scaled: a visibly different model."""
    return -50 * ExpertsInterface._global_mapping["grouped_mm"](self, hidden, index, weights)


def _moe():
    ExpertsInterface.register("test_scaled_experts", _scaled_experts)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(tiny_models.ARCHITECTURES["qwen3_moe"][1]()).eval()


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).cpu()


def test_generate_follows_set_experts_implementation():
    model = _moe()
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    want = {}
    for impl in ("grouped_mm", "test_scaled_experts"):
        model.set_experts_implementation(impl)
        want[impl] = _generate(model, ids)
    assert not torch.equal(*want.values())  # the two models differ
    model.to("tpu")
    for impl in ("grouped_mm", "test_scaled_experts", "grouped_mm"):
        model.set_experts_implementation(impl)
        assert torch.equal(_generate(model, ids.to("tpu")), want[impl]), impl
    step = vars(model)["forward"].decode_step
    assert step.trace_count == 2  # the third call found the first's program


def test_jit_forward_follows_config_changes():
    model = _moe()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = {}
        for impl in ("grouped_mm", "test_scaled_experts"):
            model.set_experts_implementation(impl)
            want[impl] = model(ids).logits
        model.to("tpu")
        forward = torchjax.jit(lambda x: model(x).logits)
        for impl in ("grouped_mm", "test_scaled_experts", "grouped_mm"):
            model.set_experts_implementation(impl)
            torch.testing.assert_close(forward(ids.to("tpu")).cpu(), want[impl])
        assert forward.trace_count == 2
        assert "config" in forward.last_retrace_reason
        model.config.output_router_logits = True  # a plain flag the forward reads
        out = forward(ids.to("tpu"))
        assert forward.trace_count == 3
    torch.testing.assert_close(out.cpu(), want["grouped_mm"])


def test_jit_follows_a_swapped_submodule_without_parameters():
    # A submodule swapped for one that brings no parameter changes no state of the call:
    # the modules themselves are part of the key (by identity and type), as Dynamo
    # guards them. Swapped back, the first program is found again.
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    m = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 4)
    f = torchjax.jit(m)
    relu = m[1]
    for swapped in (relu, torch.nn.Identity(), torch.nn.Tanh(), relu):
        m[1] = cpu[1] = swapped
        with torch.no_grad():
            torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
    assert f.trace_count == 3 and f.cache_hits == 1
    assert f.last_retrace_reason == "the submodules (one swapped for another) changed"


def test_a_new_module_at_a_freed_modules_address_traces_again():
    # A loop rebuilding an activation gets new modules at freed addresses (their id):
    # keyed by id, the program of an earlier slope ran for a later one.
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.1))
    m = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(3, 4)
    f = torchjax.jit(m, warn_after=100)
    seen, reused = set(), 0
    for i in range(40):
        m[1] = torch.nn.LeakyReLU(0.01 * (i + 1))
        cpu[1] = torch.nn.LeakyReLU(0.01 * (i + 1))
        reused += id(m[1]) in seen
        seen.add(id(m[1]))
        with torch.no_grad():
            torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
    assert reused  # addresses were reused: the case this checks
    assert f.trace_count == 40


# Note [A module's plain attributes are guards] (torchjax/compile/_attribute_guards.py):
# a plain attribute a forward reads, changed after a call, traces again and gives CPU's
# result with the new value.


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.temperature = 1.0

    def forward(self, x):
        return torch.softmax(self.linear(x) / self.temperature, -1)


def _dropout():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.0)).train()


_CHANGES = [
    # (model, its attribute's owner, name, new value): each change alters the result.
    (_dropout, lambda m: m[1], "p", 1.0),  # training mode: p=1 zeroes everything
    (
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
        lambda m: m[1],
        "eps",
        10.0,
    ),
    (
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.01)),
        lambda m: m[1],
        "negative_slope",
        0.5,
    ),
    (_Tempered, lambda m: m, "temperature", 0.25),
]


def test_a_changed_plain_attribute_traces_again():
    ran = []
    for make, owner, name, value in _CHANGES:
        torch.manual_seed(0)
        cpu = make()
        m = copy.deepcopy(cpu).to("tpu")
        f = torchjax.jit(m)
        x = torch.randn(3, 4)
        old = getattr(owner(cpu), name)
        with torch.no_grad():
            before = cpu(x)
            torch.testing.assert_close(f(x.to("tpu")).cpu(), before)
            setattr(owner(cpu), name, value)
            setattr(owner(m), name, value)
            after = cpu(x)
            assert not torch.allclose(before, after), name  # the change shows
            torch.testing.assert_close(f(x.to("tpu")).cpu(), after)
            kind = type(owner(m)).__name__
            assert f.last_retrace_reason == (
                f"the attribute {name} of a {kind} changed ({old!r} -> {value!r})"
            )
            setattr(owner(m), name, old)  # back: the first program again
            torch.testing.assert_close(f(x.to("tpu")).cpu(), before)
        assert (f.trace_count, f.cache_hits) == (2, 1), name
        ran.append(name)
    assert ran == ["p", "eps", "negative_slope", "temperature"]


def test_an_attribute_added_or_deleted_traces_again():
    class Shifted(torch.nn.Module):
        def forward(self, x):
            return x + getattr(self, "shift", 0)

    m = Shifted()
    f = torchjax.jit(m)
    x = torch.arange(3)
    torch.testing.assert_close(f(x.to("tpu")).cpu(), m(x))
    m.shift = 5
    torch.testing.assert_close(f(x.to("tpu")).cpu(), m(x))
    assert f.trace_count == 2
    assert f.last_retrace_reason == "the attribute shift of a Shifted changed (unset -> 5)"
    m.shift = 7
    torch.testing.assert_close(f(x.to("tpu")).cpu(), m(x))
    del m.shift
    torch.testing.assert_close(f(x.to("tpu")).cpu(), m(x))
    assert (f.trace_count, f.cache_hits) == (3, 1)


def test_an_attribute_the_forward_changes_is_keyed_after_the_trace():
    # A forward that counts its calls changes the attribute while tracing: keyed by the
    # value before the trace, every call would miss and trace again.
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.linear(x)

    torch.manual_seed(0)
    cpu = Counting()
    m = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
    assert (f.trace_count, f.cache_hits) == (1, 4)
    assert m.calls == 1  # the trace ran the Python once; the program does not count


def test_torch_compile_follows_a_changed_attribute():
    # torch.compile(backend="tpu") is Dynamo's: it guards on the attribute itself.
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.01))
    m = copy.deepcopy(cpu).to("tpu")
    f = torch.compile(m, backend="tpu")
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
        m[1].negative_slope = cpu[1].negative_slope = 0.5
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))


def test_a_plain_attribute_replaced_by_a_tensor_is_state():
    # Its comparison with the old float has no truth value: the module is read again,
    # and the tensor is an input of the program from then on.
    torch.manual_seed(0)
    cpu = _Tempered()
    m = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(m)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
        cpu.temperature = torch.tensor([0.5, 1.0, 2.0, 4.0])
        m.temperature = cpu.temperature.to("tpu")
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
        cpu.temperature.fill_(3.0)
        m.temperature.fill_(3.0)
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x))
    assert f.trace_count == 2
