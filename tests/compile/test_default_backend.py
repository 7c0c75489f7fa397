"""torch.compile without backend= on tpu tensors runs through the "tpu" backend
(torchjax/compile/_default_backend.py)."""

import copy

import pytest
import torch

import torchjax
from tests.compile.test_jit import mlp
from torchjax.compile import _default_backend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_default_backend_compiles_a_tpu_module_like_cpu():
    # Inductor's own "tpu" code generation used to take this graph and fail importing
    # torch_tpu; the graph now goes to the "tpu" backend.
    cpu = mlp()
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"))
    before = torchjax.compile.dynamo_stats()["graphs"]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = compiled(x.to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), cpu(x), rtol=1e-5, atol=1e-6)
    assert torchjax.compile.dynamo_stats()["graphs"] == before + 1


def test_default_backend_graph_making_tpu_tensors_from_ints():
    # No tensor input: the graph's own values say it runs on tpu.
    f = torch.compile(lambda n: torch.arange(n, device="tpu") * 2)
    torch.testing.assert_close(f(4).cpu(), torch.arange(4) * 2)


def test_cpu_graphs_are_left_to_inductor():
    gm = torch.fx.symbolic_trace(lambda a: a.sin())
    assert _default_backend.route(gm, [torch.ones(2)]) is None
    # A tpu input is routed (the "tpu" backend's callable).
    gm = torch.fx.symbolic_trace(lambda a: a.sin())
    run = _default_backend.route(gm, [torch.ones(2, device="tpu")])
    torch.testing.assert_close(run(torch.ones(2, device="tpu")).cpu(), torch.ones(2).sin())


def test_the_route_is_a_recorded_patch():
    names = [p.name for p in torchjax.patches()]
    assert "torch._TorchCompileInductorWrapper.__call__" in names
