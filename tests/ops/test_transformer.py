"""nn.MultiheadAttention / nn.TransformerEncoderLayer / nn.TransformerEncoder inference
fast paths (torchjax/ops/transformer.py), compared with CPU torch in eval() + no_grad().
The encoder's nested-tensor path: tests/ops/test_transformer_nested.py."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import torchjax  # noqa: F401
from torchjax.ops import registry

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5, equal_nan=True)
B, T, D, H = 3, 5, 16, 4


@contextlib.contextmanager
def _calls(op):
    """Counts the calls reaching ``op``'s handler (to prove the fast path was taken)."""
    calls = []
    orig = registry._handler_for(op)

    def spy(args, kwargs):
        calls.append(op)
        return orig(args, kwargs)

    registry._HANDLERS[op] = spy
    try:
        yield calls
    finally:
        registry._HANDLERS[op] = orig


def _masks(kind):
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 3:] = True
    kpm[2, 1:] = True
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    return {
        "none": (None, None),
        "kpm": (None, kpm),
        "attn": (causal, None),
        "both": (causal, kpm),
    }[kind]


def _tpu(x):
    return None if x is None else x.to("tpu")


def _assert_close(got, want):
    if want is None:
        assert got is None
        return
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), want, **TOL)


@pytest.mark.parametrize("masks", ["none", "kpm", "attn", "both"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(masks, need_weights, average, batch_first):
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=batch_first).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn((B, T, D) if batch_first else (T, B, D))
    attn_mask, kpm = _masks(masks)
    kw = dict(need_weights=need_weights, average_attn_weights=average)
    with torch.no_grad():
        want = cpu(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm, **kw)
        xt = _tpu(x)
        with _calls(aten._native_multi_head_attention.default) as calls:
            got = tpu(xt, xt, xt, attn_mask=_tpu(attn_mask), key_padding_mask=_tpu(kpm), **kw)
    assert len(calls) == (1 if batch_first else 0)
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])


def test_multihead_attention_3d_attn_mask():
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=True).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    attn_mask = torch.rand(B * H, T, T) > 0.7
    attn_mask[..., 0] = False
    with torch.no_grad():
        want = cpu(x, x, x, attn_mask=attn_mask, average_attn_weights=False)
        xt = _tpu(x)
        got = tpu(xt, xt, xt, attn_mask=_tpu(attn_mask), average_attn_weights=False)
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])


def test_multihead_attention_grad_mode_matches():
    """With grad enabled the module composes ops (no fast path); values still match."""
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=True).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    _, kpm = _masks("kpm")
    want = cpu(x, x, x, key_padding_mask=kpm)
    xt = _tpu(x)
    got = tpu(xt, xt, xt, key_padding_mask=_tpu(kpm))
    _assert_close(got[0].detach(), want[0].detach())


@pytest.mark.parametrize("masks", ["none", "kpm", "attn", "both"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(masks, activation, norm_first):
    torch.manual_seed(0)
    cpu = nn.TransformerEncoderLayer(
        D, H, 32, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    ).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    attn_mask, kpm = _masks(masks)
    with torch.no_grad():
        want = cpu(x, src_mask=attn_mask, src_key_padding_mask=kpm)
        with _calls(aten._transformer_encoder_layer_fwd.default) as calls:
            got = tpu(_tpu(x), src_mask=_tpu(attn_mask), src_key_padding_mask=_tpu(kpm))
    assert len(calls) == 1
    _assert_close(got, want)


def test_transformer_encoder_no_mask_and_causal():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)
    cpu = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D)).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    with torch.no_grad():
        _assert_close(tpu(_tpu(x)), cpu(x))
        _assert_close(tpu(_tpu(x), mask=_tpu(causal)), cpu(x, mask=causal))


# ---------------------------------------------------------------------------------------
# the ATen ops directly


@pytest.mark.parametrize(
    "mask_shape,mask_type", [((T, T), 0), ((B, T), 1), ((B, H, T, T), 2), ((B, H, T, T), None)]
)
def test_masked_softmax(mask_shape, mask_type):
    torch.manual_seed(0)
    x = torch.randn(B, H, T, T)
    mask = torch.rand(mask_shape) > 0.6
    mask.view(-1)[:T] = True  # at least one fully masked row: NaN on CPU
    want = torch._masked_softmax(x, mask, 3, mask_type)
    got = torch._masked_softmax(_tpu(x), _tpu(mask), 3, mask_type)
    _assert_close(got, want)


def test_masked_softmax_errors():
    x, mask = torch.randn(B, H, T, T), torch.zeros(T, T, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="Mask Type should be defined"):
        torch._masked_softmax(x, mask, 3)
    with pytest.raises(RuntimeError, match="aten::_masked_softmax: Mask Type should be defined"):
        torch._masked_softmax(_tpu(x), _tpu(mask), 3)


def test_transform_bias_rescale_qkv():
    torch.manual_seed(0)
    qkv, bias = torch.randn(B, T, 3 * D), torch.randn(3 * D)
    want = torch._transform_bias_rescale_qkv(qkv, bias, H)
    got = torch._transform_bias_rescale_qkv(_tpu(qkv), _tpu(bias), H)
    for g, w in zip(got, want):
        _assert_close(g, w)


def test_native_multi_head_attention_errors():
    q = _tpu(torch.randn(B, T, D))
    w, b = _tpu(torch.randn(3 * D, D)), _tpu(torch.randn(3 * D))
    pw, pb = _tpu(torch.randn(D, D)), _tpu(torch.randn(D))
    with pytest.raises(
        RuntimeError, match="aten::_native_multi_head_attention: passed-in embed_dim"
    ):
        torch._native_multi_head_attention(q, q, q, D + 1, H, w, b, pw, pb)
    with pytest.raises(RuntimeError, match="aten::_native_multi_head_attention: expected 3-D"):
        torch._native_multi_head_attention(q[0], q[0], q[0], D, H, w, b, pw, pb)


def test_multihead_attention_bfloat16():
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=True).eval().to(torch.bfloat16)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D, dtype=torch.bfloat16)
    _, kpm = _masks("kpm")
    with torch.no_grad():
        want = cpu(x, x, x, key_padding_mask=kpm)
        xt = _tpu(x)
        got = tpu(xt, xt, xt, key_padding_mask=_tpu(kpm))
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=2e-2, atol=2e-2, equal_nan=True)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=2e-2, atol=2e-2, equal_nan=True)


@pytest.mark.parametrize("mask_shape,mask_type", [((T, T), 0), ((B, T), 1), ((B, H, T, T), 2)])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_native_multi_head_attention_mask_types(mask_shape, mask_type, need_weights, average):
    torch.manual_seed(0)
    q = torch.randn(B, T, D)
    w, b = torch.randn(3 * D, D) / 4, torch.randn(3 * D)
    pw, pb = torch.randn(D, D) / 4, torch.randn(D)
    mask = torch.rand(mask_shape) > 0.6
    mask.view(-1)[:T] = True  # a fully masked row (or batch): NaN on CPU
    args = (D, H)
    want = torch._native_multi_head_attention(
        q, q, q, *args, w, b, pw, pb, mask, need_weights, average, mask_type
    )
    qt = _tpu(q)
    got = torch._native_multi_head_attention(
        qt,
        qt,
        qt,
        *args,
        _tpu(w),
        _tpu(b),
        _tpu(pw),
        _tpu(pb),
        _tpu(mask),
        need_weights,
        average,
        mask_type,
    )
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])


def test_multihead_attention_fully_padded_batch():
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(D, H, batch_first=True).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(B, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0] = True
    with torch.no_grad():
        want = cpu(x, x, x, key_padding_mask=kpm)
        xt = _tpu(x)
        got = tpu(xt, xt, xt, key_padding_mask=_tpu(kpm))
    assert torch.isnan(want[0][0]).all()
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])
