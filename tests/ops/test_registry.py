"""The registry's fallbacks (torchjax/ops/registry.py): torch._prims' ops and the error
for an op without a lowering."""

import pytest
import torch
import torch._refs as refs

import torchjax  # noqa: F401

prims = torch.ops.prims

_PRIM_CALLS = {
    "add": lambda t: prims.add(t, t),
    "mul": lambda t: prims.mul(t, t),
    "div": lambda t: prims.div(t, t + 1),
    "sin": lambda t: prims.sin(t),
    "sqrt": lambda t: prims.sqrt(t.abs()),
    "maximum": lambda t: prims.maximum(t, -t),
    "where": lambda t: prims.where(t > 0, t, -t),
    "broadcast_in_dim": lambda t: prims.broadcast_in_dim(t, [2, 3], [1]),
    "sum": lambda t: prims.sum(t, [0]),
    "convert_element_type": lambda t: prims.convert_element_type(t, torch.float64),
    "bitwise_and": lambda t: prims.bitwise_and(t.int(), t.int() + 1),
    "refs.softmax": lambda t: refs.softmax(t, 0),
    "refs.addcmul": lambda t: refs.addcmul(t, t, t, value=0.5),
    "refs.clamp": lambda t: refs.clamp(t, -0.5, 0.5),
}


@pytest.mark.parametrize("name", sorted(_PRIM_CALLS))
def test_prims_and_refs_run_as_on_cpu(name):
    # torch._refs is written in torch._prims' ops, which carry their ATen implementation.
    call = _PRIM_CALLS[name]
    x = torch.tensor([0.5, -1.25, 2.0])
    want = call(x)
    got = call(x.to("tpu"))
    assert got.device.type == "tpu"
    # float32 tolerance: exp/sin are XLA's, not CPU's SLEEF (last-bit differences)
    torch.testing.assert_close(got.cpu(), want)


def test_missing_lowering_names_the_ops_namespace():
    lib = torch.library.Library("torchjax_registry_test", "DEF")
    lib.define("frob(Tensor x) -> Tensor")
    lib.impl("frob", lambda x: x + 1, "CPU")
    x = torch.ones(2, device="tpu")
    with pytest.raises(NotImplementedError, match=r"torchjax_registry_test::frob\.default"):
        torch.ops.torchjax_registry_test.frob(x)


def test_an_out_view_of_another_size_is_resized_in_its_storage():
    # CPU resizes out= in place: a view of a bigger tensor keeps writing into it.
    results = []
    for dev in ("cpu", "tpu"):
        flat = torch.zeros(6, device=dev)
        torch.add(torch.ones(4, device=dev), 1, out=flat[1:4])
        rows = torch.zeros(3, 3, device=dev)
        torch.mul(torch.ones(2, 2, device=dev), 3, out=rows[:2])
        joined = torch.zeros(6, device=dev)
        torch.cat([torch.ones(2, device=dev), torch.full((3,), 2.0, device=dev)], out=joined[1:])
        results.append([flat.cpu(), rows.cpu(), joined.cpu()])
    for got, want in zip(*reversed(results)):
        assert torch.equal(got, want)
