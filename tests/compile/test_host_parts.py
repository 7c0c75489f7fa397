"""Copies to the host inside torch.compile(backend="tpu") graphs run eagerly, the rest
compiled (Note [Host copies in compiled graphs] in torchjax/compile/_host_parts.py)."""

import copy

import pytest
import torch

import torchjax
from torchjax.compile import _host_parts

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _cpu_then_add(x):
    return (x * 2).cpu() + 1, x.sum()


def _to_cpu_between(x):
    y = x * 2
    z = y.to("cpu")
    return z, y.sum() * 3, z.to(x.device) * 4  # back to the device after the host


def _tensor_of_elements(x):
    return torch.tensor([x[0], x[1]]) * 2, x.exp()


def _metric_on_host(x):
    loss = (x.sin() ** 2).mean()
    return loss, (x.argmax() == 1).cpu().float()


_FNS = {f.__name__.lstrip("_"): f for f in (_cpu_then_add, _to_cpu_between,
                                              _tensor_of_elements, _metric_on_host)}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_FNS))
def test_host_copies_match_eager_in_one_graph(name):
    fn = _FNS[name]
    compiled = torch.compile(fn, backend="tpu", fullgraph=True)
    before = torchjax.compile.dynamo_stats()
    for step in range(2):  # the trace, then the compiled parts again
        x = torch.arange(4.0, device="tpu") * (step + 1) - 1
        want, got = fn(x), compiled(x)
        assert len(got) == len(want) >= 2
        for w, g in zip(want, got):
            assert g.device == w.device and g.dtype == w.dtype
            torch.testing.assert_close(g.cpu(), w.cpu())
    after = torchjax.compile.dynamo_stats()
    assert after["graphs"] - before["graphs"] == 1
    assert after["traces"] - before["traces"] >= 1  # the device part was compiled
    assert after["cache_hits"] > before["cache_hits"]  # and reused


def _update_then_copy(p):
    p.add_(1)  # no node uses its result: only its order puts it before the copy
    return p * 10, p.cpu()


def _update_through_a_view(p):
    p[0:2].add_(1)
    c = p.cpu()
    p.mul_(2)
    return p + 1, c


def _copy_update_copy(p):
    before = p.cpu()
    p.add_(5)
    return before, p.cpu(), p.sum()


_UPDATES = {f.__name__.lstrip("_"): f for f in (_update_then_copy, _update_through_a_view,
                                                 _copy_update_copy)}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_UPDATES))
def test_in_place_updates_and_host_copies_keep_the_functions_order(name):
    # The parts of a split graph run in the graph's order: a copy to the host after an
    # in-place update reads the updated value, on every call.
    fn = _UPDATES[name]
    compiled = torch.compile(fn, backend="tpu", fullgraph=True)
    for step in range(2):
        x = torch.arange(4.0, device="tpu") * (step + 1)
        want_x, got_x = x.clone(), x.clone()
        want, got = fn(want_x), compiled(got_x)
        assert len(got) == len(want) >= 2
        for w, g in zip(want, got):
            assert g.device == w.device and g.dtype == w.dtype
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(got_x.cpu(), want_x.cpu(), rtol=0, atol=0)


class _Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        loss = torch.nn.functional.mse_loss(self.fc(x).squeeze(-1), y)
        return loss, loss.detach().cpu()


def test_training_step_that_logs_its_loss_on_the_host():
    cpu = _Regressor()
    tpu = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(tpu, backend="tpu", fullgraph=True)
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.ones(5)
    want, logged = cpu(x, y)
    got, got_logged = compiled(x.to("tpu"), y.to("tpu"))
    assert got_logged.device.type == "cpu"
    torch.testing.assert_close(got_logged, logged)
    want.backward()
    got.backward()
    for p, q in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)


def _host_node_names(fn):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(torch.arange(4.0, device="tpu"))
    (gm,) = graphs
    return sorted(n.name for n in _host_parts.host_nodes(gm))


def test_host_nodes_are_the_copies_and_what_uses_them():
    assert _host_node_names(lambda x: ((x * 2).sum(), x.exp())) == []
    # ``y.sum() * 3`` stays on the device though it follows the copy in the graph.
    assert _host_node_names(_to_cpu_between) == ["mul_2", "to_1", "z"]
    assert _host_node_names(_tensor_of_elements) == ["mul", "tensor"]
