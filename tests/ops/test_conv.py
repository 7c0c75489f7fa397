"""Tests for torchjax/ops/conv.py: OpInfo sweep plus what OpInfo misses."""

import functools

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import grads_match

OPS = [
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.conv3d",
    "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
]
globals().update(make_tests(OPS))


# This file's gradient checks keep their own tolerance (grads_match defaults to 1e-7).
_grads_match = functools.partial(grads_match, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(stride=2, padding=1, dilation=2, groups=2),
        dict(padding="same", dilation=2),
        dict(padding="same"),
        dict(padding="valid", stride=3),
    ],
)
def test_conv2d_options_forward_backward(kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4 // kw.get("groups", 1), 3, 2, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    _grads_match(lambda x, w, b: F.conv2d(x, w, b, **kw), x, w, b)


def test_conv_transpose2d_output_padding_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64)
    _grads_match(
        lambda x, w: F.conv_transpose2d(
            x, w, stride=2, padding=1, output_padding=1, groups=2, dilation=1
        ),
        x,
        w,
    )


def test_conv1d_unbatched():
    x, w = torch.randn(3, 10), torch.randn(5, 3, 4)
    _grads_match(lambda x, w: F.conv1d(x, w, stride=2), x, w)


def test_conv_channel_error():
    x, w = torch.randn(1, 3, 5, 5).to("tpu"), torch.randn(2, 4, 3, 3).to("tpu")
    with pytest.raises(RuntimeError, match="aten::convolution"):
        torch.ops.aten.convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


def test_conv3d_and_transpose3d():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 5, 3, generator=g, dtype=torch.float64)
    w = torch.randn(4, 1, 2, 3, 2, generator=g, dtype=torch.float64)
    _grads_match(lambda x, w: F.conv3d(x, w, stride=(1, 2, 1), padding=1, groups=2), x, w)
    wt = torch.randn(2, 3, 2, 2, 2, generator=g, dtype=torch.float64)
    _grads_match(lambda x, w: F.conv_transpose3d(x, w, stride=2, output_padding=1), x, wt)


_A = torch.ops.aten.convolution.default
_SHAPE_REFUSALS = {
    "2d_weight": lambda x, d: torch.nn.functional.conv1d(x[0], x[0]),
    "aten_2d_weight": lambda x, d: _A(
        x, torch.randn(4, 7).to(d), None, [1], [0], [1], False, [0], 1
    ),
    "ndim_mismatch": lambda x, d: _A(
        x, torch.randn(4, 7, 3, 3).to(d), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1
    ),
    "transposed_channels": lambda x, d: torch.nn.functional.conv_transpose1d(
        x, torch.randn(4, 3, 4).to(d)
    ),
    "groups_channels": lambda x, d: torch.nn.functional.conv1d(
        x, torch.randn(4, 3, 4).to(d), groups=2
    ),
}


@pytest.mark.parametrize("case", sorted(_SHAPE_REFUSALS))
def test_convolution_shape_refusals_have_cpus_text(case):
    x = torch.randn(4, 7, 33)
    with pytest.raises(RuntimeError) as cpu:
        torch.manual_seed(0)
        _SHAPE_REFUSALS[case](x, "cpu")
    with pytest.raises(RuntimeError) as tpu:
        torch.manual_seed(0)
        _SHAPE_REFUSALS[case](x.to("tpu"), "tpu")
    assert str(tpu.value).startswith(str(cpu.value)), (tpu.value, cpu.value)
