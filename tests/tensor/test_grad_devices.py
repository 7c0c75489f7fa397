"""Tests for torchjax/tensor/_grad_devices.py: a custom autograd.Function's gradients
on another device than their inputs are refused as torch's engine refuses them."""

import pytest
import torch

import torchjax


def _function(grad_for):
    """A Function ``x * 2`` whose backward returns ``grad_for(g)`` for its input."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return grad_for(g)

    return Scale


def _engine_text(index=0, expected="tpu:0", got="cpu", name="ScaleBackward"):
    return (
        f"Function {name} returned an invalid gradient at index {index} - expected device "
        f"{expected} but got {got}"
    )


def test_a_cpu_gradient_for_a_tpu_input_raises_the_engines_error():
    # Note [Gradient devices of custom Functions]: torch's engine skips the device check
    # for tensor subclasses; CUDA raises this for a CPU gradient of a CUDA input.
    fn = _function(lambda g: torch.ones(g.shape))
    x = torch.randn(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        fn.apply(x * 1.0).sum().backward()
    assert str(info.value) == _engine_text()
    assert x.grad is None


def test_the_text_is_the_engines_word_for_word():
    # The engine's own text for a mismatch it does check (a CPU input given a meta
    # gradient), with the devices swapped for the tpu case.
    def make(device):
        return _function(lambda g: torch.ones(g.shape, device=device))

    with pytest.raises(RuntimeError) as cpu:
        make("meta").apply(torch.randn(3, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError) as tpu:
        make("cpu").apply(torch.randn(3, device="tpu", requires_grad=True)).sum().backward()
    assert str(tpu.value) == str(cpu.value).replace("cpu", "tpu:0").replace("meta", "cpu")


def test_a_tpu_gradient_for_a_cpu_input_raises():
    fn = _function(lambda g: torch.ones(g.shape, device="tpu"))
    with pytest.raises(RuntimeError) as info:
        fn.apply(torch.randn(3, requires_grad=True)).sum().backward()
    assert str(info.value) == _engine_text(expected="cpu", got="tpu:0")


class _Mixed(torch.autograd.Function):
    # forward inputs: a tensor needing no grad, a number, a tensor needing one.
    @staticmethod
    def forward(ctx, a, k, b):
        return a * k + b

    @staticmethod
    def backward(ctx, g):
        return None, None, g.new_ones(g.shape, device="cpu")


def test_the_index_counts_tensor_inputs_as_the_engine_does():
    # Non-tensor inputs have no edge: b is the engine's index 1, as on CPU with a meta
    # gradient of b.
    a = torch.randn(3, device="tpu")
    b = torch.randn(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        _Mixed.apply(a, 2.0, b * 1.0).sum().backward()
    assert str(info.value) == _engine_text(index=1, name="_MixedBackward")


def test_the_engines_other_rules_come_as_on_cuda():
    # The engine checks the shape before the device: a wrong shape is its shape error; a
    # gradient the input's shape broadcasts to (summed down by the engine) is checked
    # for its device; a 0-d gradient on another device is moved to the input's.
    x = torch.randn(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match=r"got \[2\] but expected shape compatible"):
        _function(lambda g: torch.ones(2)).apply(x).sum().backward()
    with pytest.raises(RuntimeError) as info:
        _function(lambda g: torch.ones(2, 3)).apply(x).sum().backward()
    assert str(info.value) == _engine_text()
    scalar = torch.tensor(1.5, device="tpu", requires_grad=True)
    _function(lambda g: torch.tensor(3.0)).apply(scalar).backward()
    assert scalar.grad.device.type == "tpu" and scalar.grad.item() == 3.0


@pytest.mark.parametrize("compiler", ["jit", "compile"])
def test_compiled_programs_raise_the_same_error(compiler):
    fn = _function(lambda g: torch.ones(g.shape))

    def step(x):
        fn.apply(x * 1.0).sum().backward()
        return x.grad

    compiled = torchjax.jit(step) if compiler == "jit" else torch.compile(step, backend="tpu")
    x = torch.randn(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match="returned an invalid gradient at index 0 - expected"):
        compiled(x)
