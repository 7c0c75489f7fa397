"""An op or a gradient hook failing during backward() raises from backward(), never
aborts the process.

See Note [Errors inside the autograd engine] in torchjax/tensor/_backward_errors.py. The
failing op is simulated by swapping a handler, in a subprocess, so a regression (a
process abort) fails this test instead of killing the test run.
"""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import torchjax  # noqa: F401
from tests._child import completed, once_per_run


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


_EXCEPTIONS = ["NotImplementedError", "RuntimeError", "ValueError"]
_HOOKS = ["register_hook", "register_post_accumulate_grad_hook"]
_UNPACKS = ["saved_tensors_hooks", "checkpoint"]


@pytest.fixture(scope="module")
def backward_runs(request, tmp_path_factory) -> SimpleNamespace:
    # One child for every exception type, in turn (importing torch and jax is most of a
    # child's time): each failing backward must leave the process alive and the next
    # backward unaffected, so a later type also checks recovery from the earlier ones.
    code = f"""
        import torch, torchjax
        from torchjax.ops import registry
        op = torch.ops.aten.threshold_backward.default
        registry._handler_for(op)
        saved = registry._HANDLERS[op]
        _HOOKS = {_HOOKS!r}
        _UNPACKS = {_UNPACKS!r}
        for exc in ({", ".join(_EXCEPTIONS)}):
            def failing(args, kwargs):
                raise exc("no lowering for aten::threshold_backward (simulated)")
            registry._HANDLERS[op] = failing
            x = torch.randn(3).to("tpu").requires_grad_()
            b = torch.randn(3).to("tpu").requires_grad_()
            x.grad = before = torch.full((3,), 10.0).to("tpu")
            ran = []
            b.register_post_accumulate_grad_hook(lambda p: ran.append(p))
            try:
                torch.relu(x * b).sum().backward()
            except exc as e:
                print(exc.__name__, "raised:", e, flush=True)
            # as on CPU, nothing below the failing node was accumulated or hooked
            kept = x.grad is before and x.grad.tolist() == [10.0] * 3
            print(exc.__name__, "grads kept:", kept and b.grad is None and not ran, flush=True)
            registry._HANDLERS[op] = saved
            y = torch.randn(3).to("tpu").requires_grad_()
            torch.relu(y).sum().backward()  # the next backward is unaffected
            print(exc.__name__, "grad ok:", y.grad.tolist() == (y > 0).float().tolist(), flush=True)
        for kind in _HOOKS:
            z = torch.randn(3).to("tpu").requires_grad_()
            y = z * 2
            if kind == "register_hook":
                y.register_hook(lambda g: 1 / 0)
            else:
                z.register_post_accumulate_grad_hook(lambda p: 1 / 0)
            try:
                y.sum().backward()
            except ZeroDivisionError as e:
                print(kind, "raised:", e, flush=True)
            w = torch.randn(3).to("tpu").requires_grad_()
            (w * 2).sum().backward()
            print(kind, "next ok:", w.grad.tolist() == [2.0, 2.0, 2.0], flush=True)
        for kind in _HOOKS:  # a result that is no tensor: torch's own TypeError
            z = torch.randn(3).to("tpu").requires_grad_()
            getattr(z, kind)(lambda g: (g, g))
            try:
                (z * 2).sum().backward()
            except TypeError as e:
                print(kind, "result refused:", e, flush=True)
        from torch.utils.checkpoint import CheckpointError, checkpoint
        for kind in _UNPACKS:
            x = torch.randn(5).to("tpu").requires_grad_()
            if kind == "saved_tensors_hooks":
                def unpack(p):
                    raise ValueError("unpack refused")
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                    y = (x * 2).sin()
                expected = ValueError
            else:  # the recomputation differs from the forward: CheckpointError
                calls = []
                def f(x):
                    calls.append(1)
                    return (x[: 2 + len(calls)] * 2).sin()
                y = checkpoint(f, x, use_reentrant=False)
                expected = CheckpointError
            x.grad = before = torch.full((5,), 10.0).to("tpu")
            try:
                y.sum().backward()
            except expected as e:
                print(kind, "raised:", type(e).__name__, flush=True)
            kept = x.grad is before and x.grad.tolist() == [10.0] * 5
            print(kind, "grads kept:", kept, flush=True)
            w = torch.randn(3).to("tpu").requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                (w * w).sum().backward()
            print(kind, "next ok:", torch.equal(w.grad.cpu(), 2 * w.detach().cpu()), flush=True)
        """
    return SimpleNamespace(
        **once_per_run(request, tmp_path_factory, "backward_runs", lambda: completed(_run(code)))
    )


@pytest.mark.parametrize("exc", _EXCEPTIONS)
def test_error_in_backward_op_is_raised_by_backward(exc, backward_runs):
    out = backward_runs
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{exc} raised: no lowering for aten::threshold_backward (simulated)" in out.stdout
    assert f"{exc} grads kept: True" in out.stdout
    assert f"{exc} grad ok: True" in out.stdout


@pytest.mark.parametrize("kind", _HOOKS)
def test_error_in_a_gradient_hook_is_raised_by_backward(kind, backward_runs):
    # A hook raising inside the engine aborted the process on this device.
    out = backward_runs
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{kind} raised: division by zero" in out.stdout
    assert f"{kind} next ok: True" in out.stdout


@pytest.mark.parametrize("kind", _HOOKS)
def test_a_hook_returning_no_tensor_raises_cpus_type_error(kind, backward_runs):
    # torch refused the result inside the engine, where the raise aborted the process.
    out = backward_runs
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{kind} result refused: expected Variable, but hook returned 'tuple'" in out.stdout


@pytest.mark.parametrize("kind", _UNPACKS)
def test_error_in_an_unpack_hook_is_raised_by_backward(kind, backward_runs):
    # Raised while the engine unpacked a tpu tensor, it aborted the process.
    out = backward_runs
    assert out.returncode == 0, out.stderr[-2000:]
    error = "ValueError" if kind == "saved_tensors_hooks" else "CheckpointError"
    assert f"{kind} raised: {error}" in out.stdout
    assert f"{kind} grads kept: True" in out.stdout
    assert f"{kind} next ok: True" in out.stdout


def test_unpack_hooks_see_what_their_pack_hooks_returned():
    seen = []
    x = torch.randn(3, requires_grad=True)
    for dev in ("cpu", "tpu"):
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: ("packed", t), lambda p: seen.append(p[0]) or p[1]
        ) as hooks:
            y = x.to(dev) * x.to(dev)
        y.sum().backward()
        assert torch.equal(x.grad, 2 * x.detach())
        x.grad = None
    assert seen == ["packed"] * 4
    assert hooks is None  # torch's __enter__ returns nothing


def test_forward_errors_raise_directly():
    x = torch.ones(2).to("tpu")
    with pytest.raises(RuntimeError, match="tpu:0 and cpu"):
        x + torch.ones(2)


def test_complex_backward_matches_cpu():
    x = torch.randn(4, dtype=torch.complex64)
    xt = x.to("tpu").requires_grad_()
    xc = x.clone().requires_grad_()
    (xt * xt).abs().sum().backward()
    (xc * xc).abs().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-5)
