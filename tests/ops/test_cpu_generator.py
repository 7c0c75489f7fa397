"""Tests for torchjax/ops/_cpu_generator.py: random ops given a CPU generator on tpu
tensors of any layout draw exactly what they draw on CPU tensors of that layout."""

from __future__ import annotations

import pytest
import torch

# Note [CPU draws keep the layout]: CPU fills in address order, and normal_ switches
# algorithm between contiguous and other tensors, so each layout draws other values.
# Each has at least 16 elements (normal_'s contiguous path starts there).
_LAYOUTS = {  # name: (base shape, the view of the base drawn into or from)
    "transpose": ((5, 4), lambda b: b.t()),
    "strided slice": ((4, 10), lambda b: b[:, ::2]),
    "transposed slice": ((10, 4), lambda b: b[::2].t()),
    "permuted": ((2, 3, 4), lambda b: b.permute(2, 0, 1)),
    "channels last": ((2, 3, 3, 3), lambda b: b.permute(0, 3, 1, 2)),
    "expanded": ((1, 20), lambda b: b.expand(3, 20)),
}


def _matrix(x):
    while x.dim() > 2:
        x = x[0]
    return x


_OPS = {
    # in place, into the view
    "normal_": lambda x, g: x.normal_(1.0, 2.0, generator=g),
    "uniform_": lambda x, g: x.uniform_(-1.0, 3.0, generator=g),
    "bernoulli_(float)": lambda x, g: x.bernoulli_(0.3, generator=g),
    "bernoulli_(tensor)": lambda x, g: x.bernoulli_(x, generator=g),
    "exponential_": lambda x, g: x.exponential_(2.0, generator=g),
    "random_": lambda x, g: x.random_(0, 1000, generator=g),
    "cauchy_": lambda x, g: x.cauchy_(generator=g),
    "log_normal_": lambda x, g: x.log_normal_(generator=g),
    "geometric_": lambda x, g: x.geometric_(0.3, generator=g),
    "normal_ of complex64": lambda x, g: x.normal_(generator=g),
    "uniform_ of bfloat16": lambda x, g: x.uniform_(generator=g),
    "random_ of int32": lambda x, g: x.random_(generator=g),
    # out of place, from the view
    "randn_like": lambda x, g: torch.randn_like(x, generator=g),
    "rand_like": lambda x, g: torch.rand_like(x, generator=g),
    "randint_like": lambda x, g: torch.randint_like(x, 3, 10, generator=g),
    "normal(mean)": lambda x, g: torch.normal(x, 2.0, generator=g),
    "normal(std)": lambda x, g: torch.normal(1.0, x, generator=g),
    "normal(mean, std)": lambda x, g: torch.normal(x, x, generator=g),
    "bernoulli": lambda x, g: torch.bernoulli(x, generator=g),
    "bernoulli(p)": lambda x, g: torch.bernoulli(x, 0.3, generator=g),
    "aten.uniform": lambda x, g: torch.ops.aten.uniform(x, generator=g),
    "aten.normal_functional": lambda x, g: torch.ops.aten.normal_functional(x, generator=g),
    "multinomial": lambda x, g: torch.multinomial(_matrix(x), 3, generator=g),
    "multinomial(replacement)": lambda x, g: torch.multinomial(_matrix(x), 5, True, generator=g),
    # out=, the view as out
    "randn(out=)": lambda x, g: torch.randn(x.shape, generator=g, out=x),
    "rand(out=)": lambda x, g: torch.rand(x.shape, generator=g, out=x),
    "normal(out=)": lambda x, g: torch.normal(0.0, 1.0, x.shape, generator=g, out=x),
    # drawn into a clone of self (layout kept), then copied into out
    "aten.normal.out": lambda x, g: torch.ops.aten.normal.out(
        x, generator=g, out=torch.empty(x.shape, device=x.device)
    ),
    "bernoulli(out=)": lambda x, g: torch.bernoulli(
        torch.full(x.shape, 0.3, device=x.device), generator=g, out=x
    ),
}
_DTYPES = {
    "normal_ of complex64": torch.complex64,
    "uniform_ of bfloat16": torch.bfloat16,
    "random_ of int32": torch.int32,
}


def _draw(op, layout, device):
    shape, view = _LAYOUTS[layout]
    base = torch.rand(shape, generator=torch.Generator().manual_seed(1))  # values in (0, 1)
    x = view(base.to(_DTYPES.get(op, torch.float32)).to(device))
    g = torch.Generator().manual_seed(0)
    try:
        out = _OPS[op](x, g)
    except RuntimeError as e:
        return e, g
    return out, g


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("op", sorted(_OPS))
def test_cpu_generator_draws_cpus_values_in_any_layout(op, layout):
    want, g_cpu = _draw(op, layout, "cpu")
    got, g_tpu = _draw(op, layout, "tpu")
    if isinstance(want, RuntimeError):  # a write into an expanded view, as CPU
        assert isinstance(got, RuntimeError) and str(got).startswith(str(want))
        return
    assert not isinstance(got, RuntimeError), got
    assert want.numel() > 0 and got.device.type == "tpu" and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)  # bit for bit: no tolerance
    assert torch.equal(g_tpu.get_state(), g_cpu.get_state())
