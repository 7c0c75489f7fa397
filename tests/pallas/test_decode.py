"""Decode attention (torchjax/pallas/_decode.py): the Pallas kernels in interpret mode, grid
(TPU) and loop (GPU) forms, contiguous and paged caches, against the jnp reference and CPU
torch's ``F.scaled_dot_product_attention`` on the same data."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchjax.pallas import _op, _tiling, kernels

_RNG = np.random.default_rng(0)
S_MAX, BLOCK = 256, 128  # two key blocks: the second is skipped for short rows


def _arr(shape, dtype=np.float32):
    return _RNG.standard_normal(shape).astype(np.float32).astype(dtype)


def _lengths(b, sq, s=S_MAX):
    # 0 (nothing filled), sq - 1 (the first query sees nothing), one block and a bit,
    # the whole cache.
    return np.array([0, max(sq - 1, 0), BLOCK + 3, s][:b], np.int32)


def _visible(lengths, sq, s, causal=True):
    cols = np.arange(s)[None, None, None, :]
    limit = lengths[:, None, None, None]
    if causal:
        limit = limit - sq + 1 + np.arange(sq)[None, None, :, None]
    return np.broadcast_to(cols < limit, (len(lengths), 1, sq, s))


def _torch_sdpa(q, k, v, mask, out_dtype):
    """CPU torch on the same data (bool mask: True = attend); GQA by enable_gqa."""
    t = [torch.from_numpy(np.asarray(x, np.float32)).to(out_dtype) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *t, attn_mask=torch.from_numpy(np.array(mask)), enable_gqa=True
    )
    return out.float().numpy()


def _close(out, expected, dtype):
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=tol, rtol=tol)


@pytest.fixture(params=["grid", "loop"])
def form(request, monkeypatch):
    """The grid form (TPU's, interpret's) or the loop form Triton compiles, both run in
    interpret mode (Note [Kernel platforms])."""
    if request.param == "loop":
        monkeypatch.setattr(_tiling, "platform", lambda interpret: "gpu")
        # On a TPU the kernels would compile for it: the GPU form runs interpreted there too.
        monkeypatch.setattr(_op, "interpret_default", lambda: True)
    return request.param


CASES = [
    (4, 2, 1, jnp.float32),  # GQA, one token
    (4, 1, 3, jnp.float32),  # MQA, three tokens
    (2, 2, 16, jnp.bfloat16),  # MHA, sixteen tokens
    (4, 2, 4, jnp.bfloat16),  # GQA, four tokens
]


@pytest.mark.parametrize(
    "hq, hkv, sq, dtype", CASES, ids=["gqa", "mqa-sq3", "mha-sq16", "gqa-bf16"]
)
def test_matches_reference_and_cpu_torch(form, hq, hkv, sq, dtype):
    q, k = _arr((4, hq, sq, 16), dtype), _arr((4, hkv, S_MAX, 16), dtype)
    v = _arr((4, hkv, S_MAX, 16), dtype)
    lengths = _lengths(4, sq)
    out = jax.jit(lambda *a: kernels.decode_attention(*a, block_k=BLOCK))(q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == dtype
    _close(out, np.asarray(kernels.decode_attention_reference(q, k, v, lengths), np.float32), dtype)
    torch_dtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
    _close(out, _torch_sdpa(q, k, v, _visible(lengths, sq, S_MAX), torch_dtype), dtype)
    assert not np.asarray(out[0], np.float32).any()  # nothing filled: zeros, as torch


@pytest.mark.parametrize("mask_shape", [(4, 1, 1, S_MAX), (1, 4, 2, S_MAX)], ids=["pad", "full"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_on_top_of_lengths(form, mask_shape, kind):
    q, k, v = _arr((4, 4, 2, 16)), _arr((4, 2, S_MAX, 16)), _arr((4, 2, S_MAX, 16))
    keep = _RNG.random(mask_shape) < 0.7
    mask = keep if kind == "bool" else np.where(keep, _arr(mask_shape), -np.inf)
    lengths = _lengths(4, 2)
    for causal in (True, False):
        fn = functools.partial(kernels.decode_attention, causal=causal, block_k=BLOCK)
        out = jax.jit(fn)(q, k, v, lengths, mask)
        ref = kernels.decode_attention_reference(q, k, v, lengths, mask, causal=causal)
        _close(out, np.asarray(ref), jnp.float32)
        if kind == "bool":
            both = _visible(lengths, 2, S_MAX, causal) & keep
            _close(out, _torch_sdpa(q, k, v, both, torch.float32), jnp.float32)


def test_blocks_past_the_mask_end_are_skipped(form):
    # Three key blocks; a padding mask that ends in the second; keys of the third NaN
    # (inside the lengths). Skipped (Note [Decode attention]), the result equals torch's;
    # computed, the loop form would read NaN (NaN + -inf is NaN) and the grid form, whose
    # index maps repeat the last useful block, would count the second block twice.
    s = 3 * BLOCK
    q, k, v = _arr((2, 2, 1, 16)), _arr((2, 1, s, 16)), _arr((2, 1, s, 16))
    k[:, :, 2 * BLOCK :] = np.nan
    mask = np.zeros((2, 1, 1, s), bool)
    mask[:, :, :, : BLOCK + 72] = True
    out = jax.jit(lambda *a: kernels.decode_attention(*a, causal=False, block_k=BLOCK))(
        q, k, v, None, mask
    )
    k[:, :, 2 * BLOCK :] = 0.0
    _close(out, _torch_sdpa(q, k, v, mask, torch.float32), jnp.float32)


def test_stale_values_past_the_length_do_not_reach_the_output(form):
    q, k, v = _arr((2, 2, 2, 16)), _arr((2, 1, S_MAX, 16)), _arr((2, 1, S_MAX, 16))
    lengths = np.array([40, 200], np.int32)
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    out = jax.jit(lambda *a: kernels.decode_attention(*a, block_k=BLOCK))(q, k, v, lengths)
    clean_k, clean_v = np.nan_to_num(k), np.nan_to_num(v)
    expected = _torch_sdpa(q, clean_k, clean_v, _visible(lengths, 2, S_MAX), torch.float32)
    _close(out, expected, jnp.float32)


def _paged(b, hkv, sq, dtype, page=16, per_seq=8, pool=40):
    k, v = _arr((pool, hkv, page, 16), dtype), _arr((pool, hkv, page, 16), dtype)
    table = _RNG.permutation(pool)[: b * per_seq].reshape(b, per_seq).astype(np.int32)
    lengths = np.array([sq - 1, 17, 70, page * per_seq][:b], np.int32)
    # entries past a sequence's last page are never read: out of the pool on purpose
    table[0, 1:] = -1
    table[1, 2:] = pool + 5
    return k, v, table, lengths


@pytest.mark.parametrize(
    "hq, hkv, sq, dtype",
    [(4, 2, 1, jnp.float32), (4, 1, 4, jnp.float32), (4, 2, 2, jnp.bfloat16)],
    ids=["gqa", "mqa-sq4", "gqa-bf16"],
)
def test_paged_matches_reference_and_cpu_torch(form, hq, hkv, sq, dtype):
    k, v, table, lengths = _paged(4, hkv, sq, dtype)
    q = _arr((4, hq, sq, 16), dtype)
    out = jax.jit(kernels.paged_decode_attention)(q, k, v, table, lengths)
    ref = kernels.paged_decode_attention_reference(q, k, v, table, lengths)
    _close(out, np.asarray(ref, np.float32), dtype)
    # torch on the gathered cache
    safe = np.clip(table, 0, k.shape[0] - 1)
    gather = lambda p: p[safe].transpose(0, 2, 1, 3, 4).reshape(4, hkv, -1, 16)  # noqa: E731
    torch_dtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
    mask = _visible(lengths, sq, table.shape[1] * 16)
    _close(out, _torch_sdpa(q, gather(k), gather(v), mask, torch_dtype), dtype)


def test_long_cache_matches_cpu_torch():
    # S_max = 8192 at the default interpret block (2048): four key blocks, the second row
    # filled to 1500 (three skipped); GQA, two new tokens.
    s = 8192
    q, k, v = _arr((2, 4, 2, 16)), _arr((2, 2, s, 16)), _arr((2, 2, s, 16))
    lengths = np.array([s, 1500], np.int32)
    out = jax.jit(kernels.decode_attention)(q, k, v, lengths)
    expected = _torch_sdpa(q, k, v, _visible(lengths, 2, s), torch.float32)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 2, 17, 16), (1, 2, 256, 16)), {}, "Sq=17 query tokens"),
        (((1, 3, 1, 16), (1, 2, 256, 16)), {}, "multiple of Hkv"),
        (((1, 2, 1, 16), (1, 2, 256, 16)), {"block_k": 96}, "multiple of block_k=96"),
        (((1, 2, 1, 16), (1, 2, 256, 16)), {"lengths": np.zeros((2,), np.int32)}, "shape"),
        (((1, 2, 2, 16), (1, 2, 256, 16)), {"mask": np.ones((3, 256), bool)}, "mask must"),
        # An integer 0/1 mask would read as additive scores: refused, as SDPA refuses it.
        (((1, 2, 1, 16), (1, 2, 256, 16)), {"mask": np.ones((1, 256), np.int64)}, "bool or f"),
        (((1, 2, 1, 16), (1, 2, 256, 16)), {"mask": np.ones((256,), bool)}, "2 to 4 dims"),
        (((1, 2, 1, 16), (1, 2, 256, 16)), {"mask": np.ones((1,) * 4 + (256,), bool)}, "2 to 4"),
    ],
)
def test_bad_input_is_refused(shapes, kwargs, match):
    q, k = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=f"decode_attention: .*{match}"):
        kernels.decode_attention(q, k, k, **kwargs)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_dtype_the_kernel_cannot_compute_is_refused(dtype):
    # float64 ran with float32 scores and accumulator: narrowed silently.
    q, k = np.zeros((1, 2, 1, 16), dtype), np.zeros((1, 2, 256, 16), dtype)
    with pytest.raises(ValueError, match="decode_attention: q, k, v must be float32, bfloat16"):
        kernels.decode_attention(q, k, k)


def test_paged_entry_outside_the_pool_is_reported_by_an_eager_call(form):
    # Called on arrays outside any jit, the kernel's device check is queued and raised
    # at the next synchronisation point (Note [Decode attention], invalid values).
    k, v, table, lengths = _paged(2, 2, 1, np.float32)
    table[1, 1] = 40  # the pool has 40 pages; row 1 uses two pages (17 positions)
    kernels.paged_decode_attention(_arr((2, 2, 1, 16)), k, v, table, lengths)
    with pytest.raises(IndexError, match="page_table entry 40 is outside the page pool of 40"):
        torch.tpu.synchronize()
