"""Tests for torchjax/ops/sampling.py: OpInfo sweep plus what OpInfo misses."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import grads_match

OPS = [
    "nn.functional.interpolate.area",
    "nn.functional.interpolate.bicubic",
    "nn.functional.interpolate.bilinear",
    "nn.functional.interpolate.linear",
    "nn.functional.interpolate.nearest",
    "nn.functional.interpolate.nearest-exact",
    "nn.functional.interpolate.trilinear",
    "nn.functional.upsample_bilinear",
    "nn.functional.upsample_nearest",
    "_upsample_bilinear2d_aa",
    "nn.functional.grid_sample",
    "grid_sampler_2d",
    "grid_sampler_3d",
    "nn.functional.pad.circular",
    "nn.functional.pad.reflect",
    "nn.functional.pad.replicate",
    "nn.functional.pad.replicate_negative",
]
globals().update(make_tests(OPS))

_G = torch.Generator().manual_seed(0)
_X = torch.randn(2, 3, 5, 7, generator=_G, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear", "bicubic", "area"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(size=(8, 4)),
        dict(scale_factor=1.7),
        dict(scale_factor=(0.6, 2.3), recompute_scale_factor=False),
    ],
)
def test_interpolate_sizes_and_scales(mode, kw):
    for ac in [None] if mode in ("nearest", "nearest-exact", "area") else [False, True]:
        grads_match(lambda x, ac=ac: F.interpolate(x, mode=mode, align_corners=ac, **kw), _X)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(3, 4), (9, 11), (2, 13), (1, 30)])
@pytest.mark.parametrize("align_corners", [False, True])
def test_antialias(mode, size, align_corners):
    grads_match(
        lambda x: F.interpolate(
            x, size=size, mode=mode, antialias=True, align_corners=align_corners
        ),
        _X,
    )


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [False, True])
def test_integer_linear_and_cubic_refused(mode, antialias):
    # CPU accepts uint8 (a fixed-point kernel); tpu refuses instead of rounding otherwise.
    x = torch.randint(0, 256, (1, 3, 9, 9), dtype=torch.uint8, generator=_G)
    F.interpolate(x, size=(4, 5), mode=mode, antialias=antialias)
    with pytest.raises(NotImplementedError, match=r"aten::.*(bilinear|bicubic).*uint8"):
        F.interpolate(x.to("tpu"), size=(4, 5), mode=mode, antialias=antialias)


@pytest.mark.parametrize("scale", [0.3, 2.5])
def test_bicubic_antialias_float32_scale_factor(scale):
    grads_match(
        lambda x: F.interpolate(x, scale_factor=scale, mode="bicubic", antialias=True),
        _X.float().repeat(1, 1, 3, 2),
        rtol=1e-4,
        atol=1e-5,
    )


def test_interpolate_channels_last_and_half():
    x = _X.float().to(memory_format=torch.channels_last)
    grads_match(
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), x, rtol=1e-4, atol=1e-5
    )
    xb = _X.to(torch.bfloat16)
    want = F.interpolate(xb, size=(7, 3), mode="bicubic")
    got = F.interpolate(xb.to("tpu"), size=(7, 3), mode="bicubic")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), want, rtol=1.6e-2, atol=2e-2)


def test_nearest_integer_input():
    # CPU (and CUDA) torch have nearest kernels for uint8 but none for int64: int64 is
    # refused as CPU refuses it (Note [Dtype inputs torch refuses]).
    x = torch.randint(0, 100, (1, 2, 4, 5), dtype=torch.uint8)
    for mode in ("nearest", "nearest-exact"):
        want = F.interpolate(x, scale_factor=1.5, mode=mode)
        got = F.interpolate(x.to("tpu"), scale_factor=1.5, mode=mode)
        assert got.dtype == torch.uint8
        torch.testing.assert_close(got.cpu(), want)
        with pytest.raises(NotImplementedError) as refused:
            F.interpolate(x.long(), scale_factor=1.5, mode=mode)
        with pytest.raises(NotImplementedError) as got:
            F.interpolate(x.long().to("tpu"), scale_factor=1.5, mode=mode)
        assert str(got.value).startswith(str(refused.value))


# Every pair of (mode, padding_mode, align_corners) values appears in some case (a
# covering array: 9 cases instead of the 18 of the full product); each option is its
# own branch of the lowering, so pairs exercise every interaction of two of them.
_GRID_CASES = [
    ("bilinear", "zeros", False),
    ("bilinear", "border", True),
    ("bilinear", "reflection", False),
    ("nearest", "zeros", True),
    ("nearest", "border", False),
    ("nearest", "reflection", True),
    ("bicubic", "zeros", False),
    ("bicubic", "border", True),
    ("bicubic", "reflection", True),
]


@pytest.mark.parametrize("mode,padding_mode,align_corners", _GRID_CASES)
def test_grid_sample_modes(mode, padding_mode, align_corners):
    grid = torch.rand(2, 4, 6, 2, generator=_G, dtype=torch.float64) * 2.4 - 1.2
    kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    grads_match(lambda x, g: F.grid_sample(x, g, **kw), _X, grid)
    if mode != "bicubic":
        x3 = torch.randn(2, 3, 4, 5, 3, generator=_G, dtype=torch.float64)
        grid3 = torch.rand(2, 4, 3, 2, 3, generator=_G, dtype=torch.float64) * 2.4 - 1.2
        grads_match(lambda x, g: F.grid_sample(x, g, **kw), x3, grid3)


@pytest.mark.parametrize("pad", [(1, 2, 2, 0), (-1, 2, 2, -1)])
def test_replicate_pad_negative_and_3d(pad):
    grads_match(lambda x: F.pad(x, pad, mode="replicate"), _X)
    x5 = torch.randn(2, 3, 5, 4, 3, generator=_G, dtype=torch.float64)
    grads_match(lambda x: F.pad(x, (1, 2, 1, -1, 1, 0), mode="replicate"), x5)


def test_errors_name_the_op():
    x = _X.to("tpu")
    with pytest.raises(RuntimeError, match="aten::grid_sampler_3d"):
        torch.ops.aten.grid_sampler_3d(x[None], torch.zeros(2, 1, 1, 1, 3).to("tpu"), 2, 0, False)
    with pytest.raises(RuntimeError, match="aten::upsample_bilinear2d"):
        torch.ops.aten.upsample_bilinear2d(x[0], [4, 4], False)


@pytest.mark.parametrize("mode,size", [("bilinear", 3), ("bilinear", 4), ("bicubic", 3)])
def test_antialiased_interpolate_keeps_nan_in_its_window(mode, size):
    # Short tap rows are padded; the padding must add nothing (it read x[0] * 0).
    x = torch.arange(1.0, 8.0).reshape(1, 1, 1, 7)
    x[..., 0] = float("nan")
    want = F.interpolate(x, size=(1, size), mode=mode, antialias=True)
    got = F.interpolate(x.to("tpu"), size=(1, size), mode=mode, antialias=True).cpu()
    assert want[..., -1].isfinite().all()
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize(
    "size,scales", [((7, 9), (1.3, 2.1)), ((3, 3), (0.4, 0.5)), ((9, 11), (3.1, 1.7))]
)
def test_bilinear_with_scales_past_the_sizes_reads_the_last_row(size, scales, align_corners):
    # A caller's scale can put a source index past the last row (7 rows from 4 at scale
    # 1.3): ATen clamps the index and its weight; the gather read NaN there.
    x = torch.arange(20.0).reshape(1, 1, 4, 5)
    op = torch.ops.aten.upsample_bilinear2d.default
    want = op(x, list(size), align_corners, *scales)
    got = op(x.to("tpu"), list(size), align_corners, *scales)
    torch.testing.assert_close(got.cpu(), want)
