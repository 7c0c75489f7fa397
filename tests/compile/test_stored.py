"""Tensors a jitted forward stores on its modules (Note [Tensors a trace stores in module
attributes] in torchjax/compile/_stored.py)."""

import copy

import pytest
import torch

import torchjax


class Box:
    pass


class Keeper(torch.nn.Module):
    """A layer that keeps what it computed: an attribute, a list, a dict, nested
    containers and a plain object."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.history = []

    def forward(self, x):
        y = self.lin(x)
        self.cache = y * 2
        self.history.append(y)
        self.stats = {"mean": y.mean()}
        self.nested = {"layers": [(y - 1,)]}
        self.box = Box()
        self.box.last = y.sum(0)
        return y


def _kept(m):
    return [
        m.cache,
        m.history[-1],
        m.stats["mean"],
        torch.tensor(len(m.history)),
        m.nested["layers"][0][0],
        m.box.last,
    ]


def _run(m, call, device, n=3):
    """Outputs of ``call`` (``m`` or its compiled form) and what ``m`` keeps after each
    of ``n`` calls, on CPU."""
    got = []
    with torch.no_grad():
        for i in range(n):
            out = call(torch.full((2, 3), float(i)).to(device) + 1)
            got.append([t.cpu() for t in (out, *_kept(m))])
    return got


def test_attributes_set_in_forward_hold_the_calls_values():
    torch.manual_seed(0)
    cpu = Keeper()
    eager = copy.deepcopy(cpu).to("tpu")
    jitted = copy.deepcopy(cpu).to("tpu")
    want = _run(cpu, cpu, "cpu")
    for got in (_run(eager, eager, "tpu"), _run(jitted, torchjax.jit(jitted), "tpu")):
        for step, step_w in zip(got, want, strict=True):
            for t, w in zip(step, step_w, strict=True):
                torch.testing.assert_close(t, w)
    # What the module keeps is concrete: usable by eager ops after the call.
    assert torch.equal((jitted.cache + 1).cpu(), want[-1][1] + 1)
    assert len(jitted.history) == 3


def test_a_function_storing_on_a_module_it_reaches():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    model = copy.deepcopy(lin).to("tpu")

    @torchjax.jit
    def f(x):
        model.last = model(x).relu()
        return x + 1

    x = torch.randn(2, 3)
    with torch.no_grad():
        f(x.to("tpu"))
        want = lin(x).relu()
    torch.testing.assert_close(model.last.cpu(), want)


def test_a_stored_tensor_with_autograd_history_is_refused_and_put_back():
    m = Keeper().to("tpu")
    m.history.append(torch.zeros(2, 3, device="tpu"))
    f = torchjax.jit(m)
    x = torch.ones(2, 3, device="tpu")
    with pytest.raises(RuntimeError, match=r"stored a tensor with autograd history in Keeper\."):
        f(x)
    # The trace's changes are put back: no tracer is left on the module.
    assert not hasattr(m, "cache") and not hasattr(m, "nested") and not hasattr(m, "box")
    assert len(m.history) == 1
    m(x).sum().backward()  # eager still works, and so does the compiled call without grad
    with torch.no_grad():
        f(x)
    assert len(m.history) == 3 and m.cache.grad_fn is None


def test_a_stored_jax_array_of_the_trace_is_refused():
    class ToJax(torch.nn.Module):
        def forward(self, x):
            self.arr = torchjax.to_jax(x * 2)
            return x

    m = ToJax()
    with pytest.raises(RuntimeError, match=r"stored a jax array of its trace in ToJax\.arr"):
        torchjax.jit(m)(torch.ones(3, device="tpu"))
    assert not hasattr(m, "arr")


def test_a_trace_that_does_not_run_leaves_no_stored_tensor():
    m = Keeper().to("tpu")
    f = torchjax.jit(m)
    with torch.no_grad():
        f.trace(torch.ones(2, 3, device="tpu"))
    assert not hasattr(m, "cache") and not hasattr(m, "box") and m.history == []
