"""A user's torch.Tensor subclass moved to tpu keeps its class, as on CPU
(Note [User tensor subclasses on tpu])."""

import io
import pickle

import pytest
import torch

import torchjax  # noqa: F401


class Tagged(torch.Tensor):
    def tag(self):
        return "tagged"


class Logged(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Logged.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class Slotted(torch.Tensor):
    __slots__ = ("extra",)


@pytest.mark.parametrize("cls", [Tagged, Logged])
def test_ops_keep_the_class_as_on_cpu(cls):
    base = torch.randn(4, 3)
    cpu = base.as_subclass(cls)
    tpu = cpu.to("tpu")
    assert isinstance(tpu, cls) and tpu.device.type == "tpu"
    results = 0
    for op in (lambda t: t * 2 + 1, lambda t: t.sum(0), lambda t: t.t()[1:], torch.relu):
        want, got = op(cpu), op(tpu)
        assert isinstance(want, cls) and isinstance(got, cls)
        assert got.device.type == "tpu"
        back = got.cpu()
        assert isinstance(back, cls) and back.device.type == "cpu"
        torch.testing.assert_close(back.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
        results += 1
    parts = tpu.split(2)
    assert len(parts) == 2 and all(isinstance(p, cls) for p in parts)
    assert results == 4


def test_user_methods_and_functions_see_the_class():
    t = torch.ones(3).as_subclass(Tagged).to("tpu")
    assert t.tag() == "tagged"
    Logged.calls.clear()
    x = torch.ones(3).as_subclass(Logged).to("tpu")
    y = x + 1
    assert isinstance(y, Logged) and "add" in "".join(Logged.calls)


def test_aliasing_and_in_place_as_on_cpu():
    base = torch.arange(6.0)
    cpu = base.clone().as_subclass(Tagged)
    tpu = cpu.to("tpu")
    for t in (cpu, tpu):
        t.add_(1)
        t[2:].fill_(0)
    torch.testing.assert_close(tpu.cpu().as_subclass(torch.Tensor), cpu.as_subclass(torch.Tensor))


def test_gradients_flow_through_the_move():
    x_cpu = torch.randn(5, requires_grad=True)
    x_tpu = x_cpu.detach().clone().requires_grad_()
    (x_cpu.as_subclass(Tagged) ** 2).sum().backward()
    (x_tpu.as_subclass(Tagged).to("tpu") ** 2).sum().backward()
    torch.testing.assert_close(x_tpu.grad, x_cpu.grad)


def test_pickle_and_save_keep_the_class():
    t = torch.arange(4.0).as_subclass(Tagged).to("tpu")
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    copies = [pickle.loads(pickle.dumps(t)), torch.load(buf, weights_only=False)]
    for c in copies:
        assert isinstance(c, Tagged) and c.device.type == "tpu"
        torch.testing.assert_close(c.cpu().as_subclass(torch.Tensor), torch.arange(4.0))
    assert len(copies) == 2


def test_a_slotted_subclass_gets_a_clear_error():
    with pytest.raises(TypeError, match="Slotted: its __slots__"):
        torch.ones(2).as_subclass(Slotted).to("tpu")


def test_parameters_keep_their_own_path():
    p = torch.nn.Parameter(torch.randn(2))
    moved = p.to("tpu")
    assert not isinstance(moved, Tagged) and moved.device.type == "tpu"


def test_printing_names_the_class_as_on_cpu():
    cpu = torch.tensor([1.5, -2.0]).as_subclass(Tagged)
    tpu = cpu.to("tpu")
    assert repr(tpu) == repr(cpu)[:-1] + ", device='tpu:0')"
    assert str(tpu * 2) == str(cpu * 2)[:-1] + ", device='tpu:0')"
    assert repr(torch.ones(1, device="tpu")) == "tensor([1.], device='tpu:0')"


@pytest.mark.parametrize("cls", [Tagged, Logged])
def test_as_subclass_back_to_a_plain_tensor(cls):
    base = torch.arange(4.0)
    cpu = base.clone().as_subclass(cls).requires_grad_()
    tpu = base.clone().as_subclass(cls).to("tpu").requires_grad_()
    want, got = cpu.as_subclass(torch.Tensor), tpu.as_subclass(torch.Tensor)
    assert type(want) is torch.Tensor and not isinstance(got, cls)
    assert got.device.type == "tpu" and repr(got).startswith("tensor(")
    (want * torch.arange(4.0)).sum().backward()  # still in the graph, as on CPU
    (got * torch.arange(4.0).to("tpu")).sum().backward()
    torch.testing.assert_close(tpu.grad.cpu().as_subclass(torch.Tensor), cpu.grad)
    with torch.no_grad():
        want.add_(1)  # an alias: a write shows through the subclass tensor
        got.add_(1)
    torch.testing.assert_close(tpu.detach().cpu().as_subclass(torch.Tensor), base + 1)
