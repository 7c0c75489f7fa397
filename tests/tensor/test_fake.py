"""Fake tpu tensors under torch.compile: inputs that are views compile and equal CPU."""

import pytest
import torch

import torchjax

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _packed(x):
    # diffusers' LTX-2 latent packing: a size-1 leading dimension through a permute.
    return (
        x.reshape(1, -1, 3, 1, 4, 1, 4, 1)
        .permute(0, 2, 4, 6, 1, 3, 5, 7)
        .flatten(4, 7)
        .flatten(1, 3)
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: x.flatten()[0].expand(1), id="expand_of_0d"),
        pytest.param(lambda x: x.flatten()[0].expand(1, 3), id="expand_of_0d_to_2d"),
        pytest.param(_packed, id="size_1_dim_through_permute"),
    ],
)
def test_a_view_input_compiles_with_the_strides_eager_gives(make):
    # Note [Fake views take eager strides]: Dynamo replays an input view's chain on the
    # fake base and compares strides with the real tensor's, size-1 dimensions included.
    x = torch.randn(1, 2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cpu_in, tpu_in = make(x), make(x.to("tpu"))
    assert tpu_in._is_view() and tpu_in.stride() == cpu_in.stride()
    fn = torch.compile(lambda t: t * 2 + 1, backend="tpu", fullgraph=True, dynamic=False)
    before = torchjax.compile.dynamo_stats()
    torch.testing.assert_close(fn(tpu_in).cpu(), cpu_in * 2 + 1)
    torch.testing.assert_close(fn(make(x.to("tpu"))).cpu(), cpu_in * 2 + 1)
    after = torchjax.compile.dynamo_stats()
    assert after["graphs"] - before["graphs"] == 1


def test_views_made_inside_a_graph_still_match_cpu():
    # Views made while tracing take ATen's strides too (the same rule as inputs').
    x = torch.randn(1, 2, 3, 4, 4, generator=torch.Generator().manual_seed(1))

    def fn(t):
        v = _packed(t)
        return v.transpose(1, 2).contiguous() + t.flatten()[0].expand(2, 1)

    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), fn(x))
