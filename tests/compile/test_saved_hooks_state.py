"""A compiled call that fails while torch's saved-tensor hooks are switched off (a
``torch.func.grad`` graph under Dynamo switches them off as a node of its own) leaves the
process-wide switch as it found it (``saved_tensors_hooks_state_kept`` in
torchjax/_compat/torch.py): it stayed off, and non-reentrant checkpointing then failed
everywhere, in CPU code too. The trace's own hooks, taken off the stack while the
transform runs (Note [torch.func transforms in compiled programs] in
torchjax/compile/_func_transforms.py), are off it after the call too."""

import pytest
import torch
from torch.func import grad
from torch.utils.checkpoint import checkpoint

import torchjax
from torchjax.ops import registry


def _checkpoint_on_cpu_works():
    x = torch.ones(3, requires_grad=True)
    checkpoint(lambda a: a.sin() * 2, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.ones(3).cos())


def _inner_grad(a):
    return grad(lambda a: a.exp().sin().sum())(a)


def _failing_inner_grad(a):
    return grad(lambda a: a.exp().sinh().sum())(a)


@pytest.fixture
def sinh_fails_when_run(monkeypatch):
    # Dynamo's fake tensors still trace sinh; the compiled program's trace fails there,
    # between the graph's two switch nodes.
    op = torch.ops.aten.sinh.default
    registry._handler_for(op)

    def failing(args, kwargs):
        raise RuntimeError("sinh fails when run (simulated)")

    monkeypatch.setitem(registry._HANDLERS, op, failing)


@pytest.mark.usefixtures("sinh_fails_when_run")
@pytest.mark.parametrize("compiler", ["torch.compile", "torchjax.jit"])
def test_a_failed_trace_keeps_the_saved_tensor_hooks_switch(compiler):
    x = torch.randn(3, device="tpu")
    if compiler == "torch.compile":
        torch._dynamo.reset()
        f = torch.compile(_failing_inner_grad, backend="tpu")
    else:
        f = torchjax.jit(_failing_inner_grad)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    with pytest.raises(RuntimeError, match="sinh fails when run"):
        f(x)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    _checkpoint_on_cpu_works()
    if compiler == "torch.compile":
        torch._dynamo.reset()


def test_a_switch_already_off_stays_off():
    with torch.autograd.graph.disable_saved_tensors_hooks("off by the caller"):
        x = torch.randn(3, device="tpu")
        torch.testing.assert_close(
            torchjax.jit(_inner_grad)(x).cpu(), _inner_grad(x.cpu()), rtol=1e-6, atol=1e-6
        )
        assert not torch._C._autograd._saved_tensors_hooks_is_enabled()
        msg = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
        assert msg == "off by the caller"
