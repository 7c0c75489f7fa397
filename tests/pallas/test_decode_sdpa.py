"""Decode attention on tpu tensors (torchjax/pallas/_decode_sdpa.py): the torch ops against
CPU torch, and SDPA's decode rule (Note [SDPA dispatch rule]) choosing the kernel."""

import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax import pallas as tp
from torchjax.pallas import _sdpa


def _decode_qkv(dtype=torch.float32, sq=1, s=64):
    torch.manual_seed(0)
    return (
        torch.randn(2, 4, sq, 32, dtype=dtype),
        torch.randn(2, 2, s, 32, dtype=dtype),
        torch.randn(2, 2, s, 32, dtype=dtype),
    )


def _visible(lengths, sq, s):
    cols = torch.arange(s)[None, None, None, :]
    limit = lengths[:, None, None, None] - sq + 1 + torch.arange(sq)[None, None, :, None]
    return cols < limit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_cpu_sdpa(dtype):
    q, k, v = _decode_qkv(dtype, sq=3)
    lengths = torch.tensor([2, 40])  # the first row's first query sees no key
    out = tp.decode_attention(*(x.to("tpu") for x in (q, k, v)), lengths.to("tpu"))
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_visible(lengths, 3, 64), enable_gqa=True
    )
    assert out.dtype == dtype and out.device.type == "tpu"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)


def test_paged_op_matches_cpu_sdpa():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 2, 32)
    pages_k, pages_v = torch.randn(10, 2, 16, 32), torch.randn(10, 2, 16, 32)
    table = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 8]], dtype=torch.int32)
    lengths = torch.tensor([20, 64])
    out = tp.paged_decode_attention(*(x.to("tpu") for x in (q, pages_k, pages_v, table, lengths)))

    def gather(p):
        return p[table.long()].permute(0, 2, 1, 3, 4).reshape(2, 2, 64, 32)

    mask = _visible(lengths, 2, 64)
    ref = F.scaled_dot_product_attention(
        q, gather(pages_k), gather(pages_v), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_op_refuses_inputs_that_require_grad():
    q, k, v = (x.to("tpu") for x in _decode_qkv())
    with pytest.raises(RuntimeError, match="decode_attention: the decode kernel has no back"):
        tp.decode_attention(q.requires_grad_(), k, v)


def _spy(monkeypatch):
    calls, decode = [], _sdpa.decode_sdpa
    monkeypatch.setattr(
        _sdpa, "decode_sdpa", lambda *a, **kw: calls.append(a[0].shape) or decode(*a, **kw)
    )
    return calls


def test_sdpa_takes_decode_kernel_for_a_decode_call(monkeypatch):
    # transformers' decode step: q packed to (B, Hkv, group, D), a (B, 1, 1, S_max) mask.
    q, k, v = _decode_qkv()
    q = q.reshape(2, 2, 2, 32)
    mask = torch.zeros(2, 1, 1, 64, dtype=torch.bool)
    mask[0, ..., :5] = mask[1, ..., :50] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    calls = _spy(monkeypatch)
    args = [x.to("tpu") for x in (q, k, v, mask)]
    with tp.use_flash_attention(True), torch.no_grad():
        out = attend(*args)
        with torch.inference_mode():  # the registry handler decides
            inference = attend(*args)
        traced = torchjax.jit(attend)(*args)
        compiled = torch.compile(attend, backend="tpu")(*args)
    # eager, inference mode, the jit trace; Dynamo's fake pass and the backend's trace
    assert calls == [torch.Size([2, 2, 2, 32])] * 5
    for o in (out, inference, traced, compiled):
        torch.testing.assert_close(o.cpu(), ref, atol=1e-5, rtol=1e-5)
    with tp.use_flash_attention(False), torch.no_grad():  # the switch: the jnp path
        attend(*args)
    assert len(calls) == 5


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_needing_grad_keeps_the_differentiable_path(monkeypatch):
    q, k, v = (x.to("tpu").requires_grad_() for x in _decode_qkv())
    calls = _spy(monkeypatch)
    with tp.use_flash_attention(True):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out.sum().backward()
    assert calls == [] and q.grad is not None


@pytest.mark.parametrize(
    "kwargs, applies",
    [
        ({}, True),
        ({"q_len": 16}, True),
        ({"q_len": 17}, False),  # past the decode kernel's 16 rows per head
        ({"dropout_p": 0.1}, False),
        ({"is_causal": True}, False),
        ({"enable_gqa": False}, False),  # Hq != Hkv needs enable_gqa
        ({"attn_mask": torch.ones(2, 1, 1, 64, dtype=torch.bool)}, True),
        ({"attn_mask": torch.ones(4, 1, 64)}, True),  # (Hq, Sq=1, S)
        ({"attn_mask": torch.ones(2, 1, 64)}, False),  # head dim neither 1 nor Hq
        ({"attn_mask": torch.ones(1, 2, 64)}, False),  # query dim neither 1 nor Sq
        ({"attn_mask": torch.ones(1, 1, 1, 64, requires_grad=True)}, False),
        ({"kv_len": 40}, False),  # not a multiple of 16
        ({"kv_len": 2064}, False),  # past 2048, not a multiple of 128
        ({"head_dim": 24}, False),  # not a power of two
        ({"grad": True}, False),  # no backward
    ],
)
def test_decode_rule(kwargs, applies):
    kwargs = dict(kwargs)
    s, sk, d = kwargs.pop("q_len", 1), kwargs.pop("kv_len", 64), kwargs.pop("head_dim", 32)
    grad = kwargs.pop("grad", False)
    kwargs.setdefault("enable_gqa", True)
    q, k = torch.empty(2, 4, s, d, requires_grad=grad), torch.empty(2, 2, sk, d)
    assert tp.decode_applies(q, k, k, **kwargs) is applies


def _paged_inputs(table, lengths):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 2, 32)
    pages_k, pages_v = torch.randn(10, 2, 16, 32), torch.randn(10, 2, 16, 32)
    table = torch.tensor(table, dtype=torch.int32)
    return [x.to("tpu") for x in (q, pages_k, pages_v, table, torch.tensor(lengths))]


@pytest.mark.parametrize("entry", [10, -1])
def test_page_table_entry_outside_the_pool_raises_at_the_next_sync(entry):
    # A clipped page index read another page's keys: wrong values, silently. The check
    # runs on the device (Note [Decode attention], invalid values): no read at the call.
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, entry]], [20, 64])
    reads = torchjax.stats()["host_reads"]
    out = tp.paged_decode_attention(*args)
    assert torchjax.stats()["host_reads"] == reads
    with pytest.raises(
        IndexError,
        match=rf"paged_decode_attention: page_table entry {entry} is outside the page pool "
        r"of 10 pages",
    ):
        out.cpu()


def test_page_table_entries_past_the_length_are_not_checked():
    # Entries for no filled position are never read (vLLM pads tables with -1 or 0).
    args = _paged_inputs([[3, 7, -1, 99], [9, 2, 5, 8]], [20, 64])
    tp.paged_decode_attention(*args).cpu()


def test_page_table_entry_outside_the_pool_raises_at_the_call_in_immediate_mode():
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, 10]], [20, 64])
    torch.tpu.set_sync_checks(True)
    try:
        with pytest.raises(IndexError, match="page_table entry 10 is outside the page pool"):
            tp.paged_decode_attention(*args)
    finally:
        torch.tpu.set_sync_checks(False)


@pytest.mark.parametrize("length", [65, -1])
def test_length_outside_the_cache_raises(length):
    # A clipped length shifted the causal window silently; JAX's ragged paged attention
    # refuses such lengths with ValueError, as these kernels do, on the device.
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, 8]], [20, length])
    out = tp.paged_decode_attention(*args)
    with pytest.raises(ValueError, match=rf"lengths holds {length}, outside \[0, S_max=64\]"):
        out.cpu()
    q, k, v = (x.to("tpu") for x in _decode_qkv())
    torch.tpu.set_sync_checks(True)
    try:
        with pytest.raises(ValueError, match=rf"decode_attention: lengths holds {length}"):
            tp.decode_attention(q, k, v, torch.tensor([3, length], device="tpu"))
    finally:
        torch.tpu.set_sync_checks(False)


@pytest.mark.parametrize("where", [0, 4])
def test_cpu_tensor_beside_tpu_ones_is_refused(where):
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, 8]], [20, 64])
    args[where] = args[where].cpu()
    name = ["q", "k_pages", "v_pages", "page_table", "lengths"][where]
    with pytest.raises(
        RuntimeError, match=rf"Expected all tensors to be on the same device.*argument '{name}'"
    ):
        tp.paged_decode_attention(*args)
    q, k, v = (x.to("tpu") for x in _decode_qkv())
    with pytest.raises(RuntimeError, match="same device.*argument 'q'"):
        tp.decode_attention(q.cpu(), k, v)
    with pytest.raises(RuntimeError, match="same device.*argument 'lengths'"):
        tp.decode_attention(q, k, v, torch.tensor([3, 5]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64])
def test_dtype_the_kernel_cannot_compute_is_refused(dtype):
    # float64 ran with float32 scores and accumulator (narrowed silently), int32 gave
    # integer garbage: refused, as SDPA refuses integer q, k, v (RuntimeError).
    q, k, v = (x.to(dtype).to("tpu") for x in _decode_qkv())
    with pytest.raises(
        RuntimeError,
        match=f"decode_attention: q, k, v must be float32, bfloat16 or float16.*"
        f"got {str(dtype).split('.')[1]}",
    ):
        tp.decode_attention(q, k, v)
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, 8]], [20, 64])
    args[:3] = [a.to(dtype) for a in args[:3]]
    with pytest.raises(RuntimeError, match="paged_decode_attention: q, k, v must be float32"):
        tp.paged_decode_attention(*args)


def test_mixed_dtypes_are_refused_as_sdpa_refuses_them():
    q, k, v = _decode_qkv()
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same"):
        torch.nn.functional.scaled_dot_product_attention(q, k.half(), v)  # CPU's refusal
    q, k, v = (x.to("tpu") for x in (q, k.to(torch.bfloat16), v))
    with pytest.raises(RuntimeError, match="decode_attention: expected query, key, and value"):
        tp.decode_attention(q, k, v)
    args = _paged_inputs([[3, 7, 1, 0], [9, 2, 5, 8]], [20, 64])
    args[1] = args[1].to(torch.float16)
    with pytest.raises(RuntimeError, match="paged_decode_attention: expected query, key"):
        tp.paged_decode_attention(*args)
