"""nn.TransformerEncoder's nested-tensor path on tpu (torchjax/ops/transformer_nested.py,
Note [TransformerEncoder's nested path on tpu]): values, dtypes and shapes equal CPU
torch's, padded positions included, wherever CPU packs the batch and wherever it does not;
and the ops of the path called directly."""

import copy
import warnings

import pytest
import torch
from torch import nn

import torchjax
from tests.ops.test_transformer import _calls

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5, equal_nan=True)
B, T, D, H = 3, 5, 16, 4

# (N, L) key padding masks, True = padded.
MASKS = {
    "padded": [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]],
    "unpadded": [[0] * 5] * 3,
    "fully padded row": [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]],
    "not left-aligned": [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 1]],
}


def _mask(kind):
    return torch.tensor(MASKS[kind], dtype=torch.bool)


def _encoder(nested=True, norm_first=False, mask_check=True, activation="relu"):
    """A 2-layer encoder with distinct random layers and a final norm whose bias is not 0
    (so CPU's padded positions, its norm of 0, are not 0 either)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, H, 32, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    with warnings.catch_warnings():  # "enable_nested_tensor is True, but ..." (norm_first)
        warnings.simplefilter("ignore")
        enc = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(D), enable_nested_tensor=nested, mask_check=mask_check
        )
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn_like(p) / 4)
    return enc


def _run(module, x, kpm, context):
    if context == "no_grad":
        with torch.no_grad():
            return module(x, src_key_padding_mask=kpm)
    with torch.inference_mode():
        return module(x, src_key_padding_mask=kpm).clone()


def _assert_same(got, want):
    assert got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, **TOL)


def _packs_on_cpu(enc, kpm) -> bool:
    """Whether CPU's encoder packs ``kpm``'s batch (the tpu run must then too)."""
    return enc.use_nested_tensor and bool(
        torch._nested_tensor_from_mask_left_aligned(torch.zeros(B, T, D), ~kpm)
    )


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", sorted(MASKS))
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("nested", [True, False])
def test_encoder_matches_cpu(nested, norm_first, kind, context):
    cpu = _encoder(nested, norm_first).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask(kind)
    want = _run(cpu, x, kpm, context)
    with (
        _calls(aten._transformer_encoder_layer_fwd.default) as layers,
        _calls(aten._nested_tensor_from_mask.default) as packs,
    ):
        got = _run(tpu, x.to("tpu"), kpm.to("tpu"), context)
    _assert_same(got, want)
    assert len(layers) == 2  # both layers took the fused path
    assert len(packs) == int(_packs_on_cpu(cpu, kpm))
    if packs and kind != "unpadded":
        # CPU's nested path: padded positions are the final norm of 0, its bias.
        bias = cpu.norm.bias.detach().expand(int(kpm.sum()), D)
        torch.testing.assert_close(got.cpu()[kpm], bias)


@pytest.mark.parametrize("kind", ["padded", "fully padded row"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_training_mode_matches_cpu(norm_first, kind):
    cpu = _encoder(True, norm_first).train()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask(kind)
    want = cpu(x, src_key_padding_mask=kpm)
    with _calls(aten._nested_tensor_from_mask.default) as packs:
        got = tpu(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
    assert not packs
    assert got.requires_grad
    _assert_same(got.detach(), want.detach())


@pytest.mark.parametrize("kind", ["padded", "fully padded row"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_alone_matches_cpu(norm_first, kind):
    torch.manual_seed(0)
    cpu = nn.TransformerEncoderLayer(
        D, H, 32, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask(kind)
    with torch.no_grad():
        want = cpu(x, src_key_padding_mask=kpm)
        with _calls(aten._transformer_encoder_layer_fwd.default) as calls:
            got = tpu(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
    assert len(calls) == 1
    _assert_same(got, want)


@pytest.mark.parametrize("kind", ["padded", "fully padded row"])
def test_multihead_attention_without_weights_matches_cpu(kind):
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=True).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask(kind)
    with torch.no_grad():
        want, none = cpu(x, x, x, key_padding_mask=kpm, need_weights=False)
        xt = x.to("tpu")
        with _calls(aten._native_multi_head_attention.default) as calls:
            got, got_none = tpu(xt, xt, xt, key_padding_mask=kpm.to("tpu"), need_weights=False)
    assert len(calls) == 1
    assert none is None and got_none is None
    _assert_same(got, want)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layers_with_hooks_run_on_the_packed_batch(activation):
    """A forward hook turns a layer's fused path off; on CPU the layer then runs its
    Python composition on the nested tensor, on tpu on the stand-in. The hook's
    ``.cpu()`` gets CPU's nested tensor."""
    features = {"cpu": [], "tpu": []}
    encoders = {}
    for device in ("cpu", "tpu"):
        enc = _encoder(activation=activation).eval().to(device)
        for layer in enc.layers:
            layer.register_forward_hook(
                lambda m, i, out, d=device: features[d].append(out.detach().cpu())
            )
        encoders[device] = enc
    x, kpm = torch.randn(B, T, D), _mask("fully padded row")
    with torch.no_grad():
        want = encoders["cpu"](x, src_key_padding_mask=kpm)
        with _calls(aten._nested_tensor_from_mask.default) as packs:
            got = encoders["tpu"](x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
    assert len(packs) == 1
    _assert_same(got, want)
    assert len(features["tpu"]) == len(features["cpu"]) == 2
    for g, w in zip(features["tpu"], features["cpu"]):
        assert g.is_nested and g.device.type == "cpu"
        torch.testing.assert_close(g.to_padded_tensor(0.0), w.to_padded_tensor(0.0), **TOL)


def test_mask_check_false_packs_as_cpu():
    """Without the check, a mask that is not left-aligned packs each row's first ``count``
    positions, on CPU as on tpu."""
    cpu = _encoder(mask_check=False).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    ran = 0
    for kind in ("padded", "not left-aligned"):
        kpm = _mask(kind)
        with torch.no_grad():
            want = cpu(x, src_key_padding_mask=kpm)
            got = tpu(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
        _assert_same(got, want)
        ran += 1
    assert ran == 2


def test_every_row_padded_raises_as_cpu():
    enc = _encoder().eval()
    kpm = torch.ones(B, T, dtype=torch.bool)
    x = torch.randn(B, T, D)
    match = "at least one constituent tensor should have non-zero numel"
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=match):
            enc(x, src_key_padding_mask=kpm)
        tpu = enc.to("tpu")
        with pytest.raises(RuntimeError, match=match):
            tpu(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))


@pytest.mark.parametrize("mask_check", [True, False])
def test_encoder_under_jit_matches_eager(mask_check):
    """Under torchjax.jit the alignment is unknown: the stand-in gives the packed values
    for a left-aligned mask and the dense ones for another (what CPU's encoder chooses)."""
    cpu = _encoder(mask_check=mask_check).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    jitted = torchjax.jit(tpu)
    x = torch.randn(B, T, D)
    kinds = ["padded", "fully padded row", "unpadded"]
    if mask_check:  # without the check CPU packs the first positions; the trace cannot
        kinds.append("not left-aligned")
    for kind in kinds:
        kpm = _mask(kind)
        with torch.no_grad():
            want = cpu(x, src_key_padding_mask=kpm)
            got = jitted(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
        _assert_same(got, want)
    assert len(kinds) >= 3


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mask_check", [True, False])
def test_encoder_under_torch_compile_matches_cpu(mask_check):
    """torch.compile makes the encoder's choice on CPU and tpu alike: dense while
    compiling with the check on, the packed path (left to eager) with it off."""
    cpu = _encoder(mask_check=mask_check).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask("padded")
    with torch.no_grad():
        want = torch.compile(cpu, backend="eager")(x, src_key_padding_mask=kpm)
        got = torch.compile(tpu, backend="tpu")(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
    _assert_same(got, want)
    packed = bool((want[kpm] == cpu.norm.bias).all())
    assert packed == (not mask_check)


def test_encoder_in_fused_eager_matches_cpu():
    cpu = _encoder().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x, kpm = torch.randn(B, T, D), _mask("fully padded row")
    with torch.no_grad():
        want = cpu(x, src_key_padding_mask=kpm)
        with torchjax.fused():
            got = tpu(x.to("tpu"), src_key_padding_mask=kpm.to("tpu"))
    _assert_same(got, want)


# ---------------------------------------------------------------------------------------
# the ops called directly


def test_left_aligned_answers_as_cpu():
    x = torch.randn(B, T, D)
    ran = 0
    for kind in MASKS:
        keep = ~_mask(kind)
        want = torch._nested_tensor_from_mask_left_aligned(x, keep)
        got = torch._nested_tensor_from_mask_left_aligned(x.to("tpu"), keep.to("tpu"))
        assert got is want, kind
        ran += 1
    assert ran == len(MASKS)


def _packed(x, keep, **kw):
    return torch._nested_tensor_from_mask(x, keep, **kw)


def _keep(lengths):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


# (kept positions (True = keep), mask_check, to_padded_tensor's arguments)
TO_PADDED = {
    "no output_size": (_keep([5, 3, 1]), True, (0.0,)),
    "no output_size, shorter rows": (_keep([3, 2, 0]), True, (7.0,)),
    "larger output_size": (_keep([5, 3, 0]), True, (-2.0, (4, 7, 17))),
    "output_size cut to the longest row": (_keep([3, 2, 0]), True, (1.5, (B, 3, D))),
    "not left-aligned, unchecked": (~_mask("not left-aligned"), False, (9.0,)),
    "nan padding": (_keep([5, 3, 1]), True, (float("nan"),)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("case", sorted(TO_PADDED))
def test_to_padded_tensor_matches_cpu(case, dtype):
    keep, mask_check, padded_args = TO_PADDED[case]
    if dtype == torch.int64 and padded_args[0] != padded_args[0]:
        padded_args = (0.5,) + padded_args[1:]  # NaN does not convert to an integer
    x = (torch.randn(B, T, D) * 4).to(dtype)
    want = _packed(x, keep, mask_check=mask_check).to_padded_tensor(*padded_args)
    got = _packed(x.to("tpu"), keep.to("tpu"), mask_check=mask_check).to_padded_tensor(*padded_args)
    _assert_same(got, want)


ERRORS = {
    "float mask": (lambda x, keep: _packed(x, keep.float()), "Expected mask to be of ScalarType"),
    "1-D mask": (lambda x, keep: _packed(x, keep[0]), "Padding mask should be 2D"),
    "2-D input": (lambda x, keep: _packed(x[0], keep), "Input should be a 3D tensor"),
    "sizes": (lambda x, keep: _packed(x, keep[:2]), "Mask size should match input size"),
    "no rows": (lambda x, keep: _packed(x[:0], keep[:0]), "stack expects a non-empty"),
    "not left-aligned": (
        lambda x, keep: _packed(x, ~_mask("not left-aligned").to(keep.device)),
        "Mask must be left-aligned without gaps",
    ),
    "no kept position": (
        lambda x, keep: _packed(x, keep & False).to_padded_tensor(0.0),
        "at least one constituent tensor should have non-zero numel",
    ),
    "truncation": (
        lambda x, keep: _packed(x, keep).to_padded_tensor(0.0, (B, 4, D)),
        "Truncation is not supported",
    ),
    "output_size rank": (
        lambda x, keep: _packed(x, keep).to_padded_tensor(0.0, (B, T)),
        "Length of output_size does not match NestedTensor dims",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_match_cpu(case):
    fn, match = ERRORS[case]
    x, keep = torch.randn(B, T, D), ~_mask("padded")
    with pytest.raises(RuntimeError, match=match) as want:
        fn(x, keep)
    with pytest.raises(type(want.value), match=match):
        fn(x.to("tpu"), keep.to("tpu"))


def test_empty_rows_raise_index_error_as_cpu():
    x, keep = torch.randn(B, 0, D), torch.ones(B, 0, dtype=torch.bool)
    for op in (torch._nested_tensor_from_mask, torch._nested_tensor_from_mask_left_aligned):
        with pytest.raises(IndexError, match="select"):
            op(x, keep)
        with pytest.raises(IndexError, match="select"):
            op(x.to("tpu"), keep.to("tpu"))


def test_stand_in_refuses_what_it_cannot_answer():
    packed = _packed(torch.randn(B, T, D).to("tpu"), ~_mask("padded").to("tpu"))
    assert packed.is_nested and packed.dim() == 3 and "PaddedNested" in repr(packed)
    with pytest.raises(NotImplementedError, match="aten::sum.default on the padded tensor"):
        packed.sum()
    with pytest.raises(NotImplementedError, match="moves positions"):
        packed.view(B, T * D)
    # per position: answered, on the rows' positions
    doubled = (packed * 2).to_padded_tensor(0.0)
    torch.testing.assert_close(doubled.cpu(), packed.to_padded_tensor(0.0).cpu() * 2)
