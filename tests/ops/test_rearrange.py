"""Ops that rearrange elements into new tensors (torchjax/ops/rearrange.py): OpInfo
sweep plus direct cases."""

import pytest
import torch

from tests.ops.opinfo_cases import make_tests
from tests.ops.test_view_ops import both

OPS = [
    "cat",
    "stack",
    "hstack",
    "vstack",
    "repeat",
    "tile",
    "flip",
    "fliplr",
    "flipud",
    "roll",
    "tril",
    "triu",
    "constant_pad_nd",
    "nn.functional.pad.constant",
    "slice_scatter",
    "select_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "repeat_interleave",
]
globals().update(make_tests(OPS))


def test_cat_promotes_and_skips_empty_1d():
    both(lambda x: torch.cat([x.int(), x, torch.zeros(0, device=x.device)], 1))
    both(lambda x: torch.cat([torch.zeros(0, dtype=torch.float64, device=x.device), x]))
    both(lambda x: torch.cat([x.bool(), x.to(torch.bfloat16), x.half()], -1))


def test_cat_out_and_error():
    x = torch.ones(2, 3, device="tpu")
    out = torch.empty(0, device="tpu")
    assert torch.cat([x, x], out=out) is out and out.shape == (4, 3)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([x, torch.ones(2, 4, device="tpu")])


def test_pad_negative_and_value():
    both(lambda x: torch.nn.functional.pad(x, (1, -2, 0, 3), value=-7.0))
    both(lambda x: torch.nn.functional.pad(x.long(), (2, 2), value=5))


def test_tril_triu_batched_and_int64():
    both(lambda x: x.tril(-1) + x.triu(2))
    big = lambda: torch.full((3, 3), 2**40, dtype=torch.int64)  # noqa: E731
    both(lambda x: x.triu(), big)


def test_roll_flip_empty_and_zero_d():
    both(lambda x: x.roll(3), lambda: torch.zeros(0, 2))
    both(lambda x: x.flip(()), lambda: torch.tensor(1.5))
    # ATen wraps a 0-d tensor's dims as for 1-d: flip(0) / flip(-1) return the scalar.
    both(lambda x: x.flip(0), lambda: torch.tensor(1.5))
    both(lambda x: x.flip(-1), lambda: torch.tensor(1.5))


def test_flip_repeated_dim_is_torchs_error():
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="dim 1 appears multiple times"):
            torch.zeros(2, 2, device=device).flip(0, 1, 1)


def test_scatter_ops_are_view_backward():
    def fn(x):
        x.requires_grad_()
        y = x[:, 1:, ::2].select(2, 1).diagonal(0, 0, 1)
        (g,) = torch.autograd.grad(y.sum(), x)
        return g

    both(fn)


def test_cat_out_of_a_type_the_inputs_cannot_cast_to_is_a_type_error():
    for dev in ("cpu", "tpu"):
        with pytest.raises(TypeError, match="can't be cast to the desired output type Long"):
            torch.cat([torch.ones(2, device=dev)], out=torch.zeros(2, dtype=torch.long, device=dev))
    out = torch.zeros(0, dtype=torch.float64, device="tpu")
    torch.cat([torch.ones(2, dtype=torch.long, device="tpu")], out=out)
    assert out.dtype == torch.float64 and out.cpu().tolist() == [1.0, 1.0]
