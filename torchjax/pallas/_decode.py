"""Decode attention: a few new query tokens against a static or paged KV cache.

Note [Decode attention]
Decoding feeds 1 to 16 new tokens per step against a cache of ``S_max`` positions of
which ``lengths[b]`` are filled. The flash kernel (torchjax/pallas/_flash.py) fits that
badly: its query blocks want 128+ rows (the MXU's and tensor cores' height), it reads
each kv head once per query head (GQA), and it walks every key block of ``S_max``. The
decode kernels (torchjax/pallas/_decode_fwd.py) instead

- put the whole query group of one kv head in one block: q (B, Hq, Sq, D) is viewed as
  (B, Hkv, R, D) with ``R = (Hq // Hkv) * Sq`` rows (row ``r`` is query head
  ``h * group + r // Sq``, token ``r % Sq``), so one program per (batch, kv head) reads
  that head's keys and values once for all of its query heads (GQA, MQA);
- make the key sequence the reduction (the grid's last dimension on TPU and in interpret
  mode, a loop on GPU) with the online softmax in f32 scratch, so a program holds one key
  block whatever ``S_max`` is (:func:`torchjax.pallas._tiling.program_memory`);
- skip every key block at or past ``ends[b]``: its body under ``pl.when``, its fetch by
  clamping the key/value index maps to the last useful block (scalar prefetch of
  ``ends``), or, on GPU, by ending the loop there. Decode cost follows the filled
  length, not ``S_max``. ``ends[b]`` is ``lengths[b]``, lowered further by a mask: past
  the last key that any row of the mask attends, nothing is visible, so when SDPA hands
  the kernel a padding/causal mask instead of lengths (transformers' static cache) the
  skipping still follows the filled length.

Visibility: key ``j`` is visible to query ``i`` of batch ``b`` iff ``j < lengths[b]``,
and with ``causal`` ``j < lengths[b] - Sq + 1 + i`` (the new tokens are the last ``Sq``
filled positions), and the mask allows it. A row that sees no key gives zeros, as CPU
torch's SDPA does for a fully masked row (``lengths[b] < Sq`` leaves the first queries
without keys). Value rows at or past ``lengths[b]`` are zeroed before the product, so
stale cache entries past the length (a reused page, uninitialised memory, NaN) never
reach the output.

Paged layout (vLLM's, and JAX's ragged paged attention's): pages (num_pages, Hkv,
page_size, D), a page table (B, pages_per_seq) of page indices and the lengths; a key
block is one page, and the grid form's index map reads the page from the table (scalar
prefetch), the loop form loads it from the table row. Table entries past a sequence's
last useful page are never read (the index map clamps), so an unused entry may hold
anything (vLLM pads with 0 or -1).

Invalid values: a used page-table entry outside [0, num_pages) raises IndexError, a
length outside [0, S_max] ValueError. Both depend on data, so they are device checks
(Note [Device-side checks]): raised at the next synchronisation point, or at the call
with ``TORCHJAX_SYNC_CHECKS=1``, never read on the call's own path; after the call of a
``torchjax.jit`` program holding the kernel too (Note [Device checks of compiled
programs]), but not under a user's own ``jax.jit``. The kernel still clips both (a page
index to the pool, a length to S_max), so an invalid call reads no memory outside the
cache; its result is undefined, as after CUDA's device assert, and the error says so.
Why not clip silently, as before: a clipped page index reads another page's keys, and a
clipped length shifts the causal window, both plausible-looking wrong attention. JAX's
ragged paged attention refuses lengths past the pages per sequence with a ValueError
(``validate_inputs_on_runtime``, a host read); we check likewise, without a host read.

One page per grid step keeps the kernel simple at a cost for small pages (per-step
overhead, ~0.35 us on TPU); pages of 128+ tokens amortise it. The paged kernel takes no
mask (lengths and causal only).

Through SDPA (Note [SDPA dispatch rule]) the kernel sees what transformers passes: for
one new token, q packed to (B, Hkv, group, D) (``pack_gqa``), so each kv head is read
once; for several new tokens with a mask, K/V already repeated to Hq heads
(``repeat_kv``: transformers uses ``enable_gqa`` only without a mask), read once per
query head.

Limits: no gradient (decoding is inference; SDPA's dispatch rule sends calls that need
one elsewhere); ``Sq <= 16``; the mask's query dim 1 or ``Sq``, its head dim 1 or ``Hq``.
On GPU the rows are padded to a power of two of at least 16 (Triton's dot and loads).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from torchjax.device import _checks
from torchjax.pallas import _tiling
from torchjax.pallas._decode_fwd import grid_forward, loop_forward
from torchjax.pallas._flash import additive_mask, attention_reference

MAX_QUERY = 16
_I32 = jnp.int32
# The kernel's scores and accumulator are float32: float64 would be narrowed silently.
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _fail(name, what):
    raise ValueError(f"torchjax.pallas.{name}: {what}")


def _check_qkv(name, q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        _fail(name, f"expected 4-D q, k, v, got {q.shape}, {k.shape}, {v.shape}")
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    if v.shape[:3] != k.shape[:3] or k.shape[-1] != d or hq % hkv:
        _fail(
            name,
            f"expected q (B, Hq, Sq, D) and k, v of D and kv heads Hkv with Hq a multiple "
            f"of Hkv, got {q.shape}, {k.shape}, {v.shape}",
        )
    if not 1 <= sq <= MAX_QUERY:
        _fail(
            name,
            f"Sq={sq} query tokens; the decode kernel takes 1 to {MAX_QUERY}, use "
            "torchjax.pallas.kernels.flash_attention for longer queries",
        )
    if not (q.dtype == k.dtype == v.dtype):
        _fail(name, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if jnp.dtype(q.dtype) not in _DTYPES:
        _fail(name, dtype_error(q.dtype))


def dtype_error(dtype) -> str:
    return (
        f"q, k, v must be float32, bfloat16 or float16 (the kernel computes in float32), "
        f"got {dtype}; use F.scaled_dot_product_attention for float64, and floating "
        "tensors for attention"
    )


@functools.partial(jax.jit, static_argnums=1)
def _length_outside(lengths, s):
    bad = (lengths < 0) | (lengths > s)
    return jnp.any(bad), lengths[jnp.argmax(bad)]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _page_outside(table, lengths, page, n_pages):
    # Only the entries holding a position below lengths[b] are read for the result.
    used = jnp.arange(table.shape[1])[None, :] * page < lengths[:, None]
    bad = (used & ((table < 0) | (table >= n_pages))).reshape(-1)
    return jnp.any(bad), table.reshape(-1)[jnp.argmax(bad)]


def _lengths(name, lengths, b, s):
    if lengths is None:
        return jnp.full((b,), s, _I32)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        _fail(
            name,
            f"lengths must be an integer array of shape ({b},), got "
            f"{lengths.dtype}{list(lengths.shape)}",
        )
    if b:
        # Checked, not clipped silently: Note [Decode attention], invalid values.
        bad, value = _length_outside(lengths, s)
        _checks.require(
            bad,
            value,
            ValueError,
            f"torchjax.pallas.{name}: lengths holds {{value}}, outside [0, S_max={s}] "
            "(the cache's positions); the result is undefined. Pass the filled positions "
            "per batch row",
        )
    return jnp.clip(lengths.astype(_I32), 0, s)


def _rows(q, hkv):
    """q (B, Hq, Sq, D) as (B, Hkv, group * Sq, D) (Note [Decode attention])."""
    b, hq, sq, d = q.shape
    return q.reshape(b, hkv, (hq // hkv) * sq, d)


def _mask_rows(name, mask, q, s, hkv):
    """The additive mask as (Bm, Hkv or 1, group * Sq or 1, S), and the end of its last
    attended key per batch row (Bm,)."""
    b, hq, sq, _ = q.shape
    group = hq // hkv
    # SDPA's attn_mask rules: an integer mask is no additive mask (0/1 would read as
    # scores added, silently wrong), and a mask has 2 to 4 dims.
    if mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.floating):
        _fail(name, f"mask must be bool or floating, as SDPA's attn_mask, got {mask.dtype}")
    if not 2 <= mask.ndim <= 4:
        _fail(name, f"mask must have 2 to 4 dims, as SDPA's attn_mask, got {mask.shape}")
    mask = additive_mask(mask, q.dtype if mask.dtype == jnp.bool_ else mask.dtype)
    bm, hm, sm, sk = mask.shape
    if sk != s or bm not in (1, b) or hm not in (1, hq) or sm not in (1, sq):
        _fail(
            name,
            f"mask must broadcast to (B, Hq, Sq, S) = ({b}, {hq}, {sq}, {s}) with "
            f"its head dim 1 or Hq and its query dim 1 or Sq, got {mask.shape}",
        )
    seen = jnp.any(mask > -jnp.inf, axis=(1, 2))
    end = jnp.max(jnp.where(seen, jnp.arange(1, s + 1, dtype=_I32), 0), axis=-1)
    if sm > 1 or (hm > 1 and group * sq > 1):
        heads = hq if hm > 1 else group
        mask = jnp.broadcast_to(mask, (bm, heads, sq, s))
        mask = mask.reshape(bm, heads // group, group * sq, s)
    elif hm > 1:  # one row per kv head already (group * Sq == 1)
        mask = mask.reshape(bm, hkv, 1, s)
    return mask, jnp.broadcast_to(end, (b,))


def _pad_rows(x, rows):
    """Zero rows appended to (.., R, D) up to ``rows`` (the GPU form's power of two)."""
    pad = rows - x.shape[2]
    return x if pad <= 0 else jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))


def _run(q, cache, mask, lengths, ends, causal, scale, block_k, interpret, plat):
    b, hq, sq, d = q.shape
    hkv = cache[0].shape[1]
    rows = _rows(q, hkv)
    r = rows.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kw = dict(causal=bool(causal), scale=scale, sq=sq, block_k=block_k, interpret=interpret)
    if plat == "gpu":
        padded = max(16, 1 << (r - 1).bit_length())
        rows = _pad_rows(rows, padded)
        if mask is not None and mask.shape[2] > 1:
            mask = _pad_rows(mask, padded)
        out = loop_forward(rows, cache, mask, lengths, ends, plat=plat, **kw)[:, :, :r]
    else:
        out = grid_forward(rows, cache, mask, lengths, ends, plat=plat, **kw)
    return out.reshape(b, hq, sq, out.shape[-1])


def decode_block(plat: str, s: int) -> int:
    """The key block for a cache of ``s`` positions: the platform's table row
    (torchjax/pallas/_tiling.py) fitted to ``s``."""
    (want,) = _tiling.default_blocks("decode", plat)
    if plat == "gpu":
        return _tiling.fit_block(s, want, 16, whole=False)
    return _tiling.fit_block(s, want, _tiling.LANE)


def decode_attention(
    q,
    k,
    v,
    lengths=None,
    mask=None,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
):
    """Attention of ``Sq <= 16`` new tokens over a static KV cache (Note [Decode attention]).

    Args:
        q: (B, Hq, Sq, D) float32/bfloat16/float16, ``1 <= Sq <= 16``.
        k, v: the cache, (B, Hkv, S_max, D), ``Hq % Hkv == 0``, q's dtype.
        lengths: (B,) integer, filled positions per batch row, in [0, S_max] (a device
            check, Note [Decode attention]); None: all ``S_max``.
        mask: None, or boolean (True = attend) or float (added to the scores), rank 2-4,
            broadcastable to (B, Hq, Sq, S_max) with its head dim 1 or Hq and its query
            dim 1 or Sq; applied on top of ``lengths``.
        causal: query ``i`` sees keys before ``lengths[b] - Sq + 1 + i`` (the new tokens
            are the cache's last filled positions); False: all keys before ``lengths[b]``.
        scale: score scale; default ``1 / sqrt(D)``.
        block_k: keys per block (must divide S_max); default the platform's table.
        interpret: Pallas interpret mode; default on CPU only.

    Returns:
        (B, Hq, Sq, D) in q's dtype (f32 accumulation); rows that see no key are 0.

    Raises:
        ValueError: shapes or dtypes not as above, or ``block_k`` not dividing S_max;
            a length outside [0, S_max] (at the next synchronisation point).
    """
    from torchjax.pallas._op import interpret_default

    name = "decode_attention"
    _check_qkv(name, q, k, v)
    b, hq, sq, d = q.shape
    s = k.shape[2]
    interpret = interpret_default() if interpret is None else interpret
    plat = _tiling.platform(interpret)
    block_k = decode_block(plat, s) if block_k is None else min(int(block_k), s)
    if s % block_k:
        _fail(name, f"S_max={s} must be a multiple of block_k={block_k}")
    if k.shape[0] != b:
        _fail(name, f"q and the cache must have one batch size, got {q.shape}, {k.shape}")
    lengths = _lengths(name, lengths, b, s)
    ends = lengths
    if mask is not None:
        mask, mask_end = _mask_rows(name, mask, q, s, k.shape[1])
        ends = jnp.minimum(lengths, mask_end)
    return _run(q, (k, v), mask, lengths, ends, causal, scale, block_k, interpret, plat)


def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    causal: bool = True,
    scale: float | None = None,
    interpret: bool | None = None,
):
    """Attention of ``Sq <= 16`` new tokens over a paged KV cache (Note [Decode attention]).

    Args:
        q: (B, Hq, Sq, D) float32/bfloat16/float16, ``1 <= Sq <= 16``.
        k_pages, v_pages: (num_pages, Hkv, page_size, D), q's dtype; page_size a multiple
            of 8 (16 for 16-bit dtypes) on TPU, a power of two of at least 16 on GPU
            (Triton's dot); not checked here: the platform compiler refuses others.
        page_table: (B, pages_per_seq) integer page indices; position ``p`` of sequence
            ``b`` lives at ``k_pages[page_table[b, p // page_size], :, p % page_size]``.
        lengths: (B,) integer filled positions, in [0, pages_per_seq * page_size]; the
            table entries below them in [0, num_pages) (device checks, Note [Decode
            attention]).
        causal, scale, interpret: as :func:`decode_attention`.

    Returns:
        (B, Hq, Sq, D) in q's dtype.
    """
    from torchjax.pallas._op import interpret_default

    name = "paged_decode_attention"
    _check_qkv(name, q, k_pages, v_pages)
    b = q.shape[0]
    table = jnp.asarray(page_table)
    if table.ndim != 2 or table.shape[0] != b or not jnp.issubdtype(table.dtype, jnp.integer):
        _fail(
            name,
            f"page_table must be integer (B, pages_per_seq) with B={b}, got "
            f"{table.dtype}{list(table.shape)}",
        )
    page, n_pages = k_pages.shape[2], k_pages.shape[0]
    lengths = _lengths(name, lengths, b, table.shape[1] * page)
    if table.size:
        bad, value = _page_outside(table, lengths, page, n_pages)
        _checks.require(
            bad,
            value,
            IndexError,
            f"torchjax.pallas.{name}: page_table entry {{value}} is outside the page pool "
            f"of {n_pages} pages (k_pages.shape[0]); entries for positions below lengths[b] "
            f"must be in [0, {n_pages}); the result is undefined",
        )
    interpret = interpret_default() if interpret is None else interpret
    plat = _tiling.platform(interpret)
    cache = (k_pages, v_pages, table.astype(_I32))
    return _run(q, cache, None, lengths, lengths, causal, scale, page, interpret, plat)


def _visible(lengths, sq, s, causal):
    """(B, 1, Sq, S) bool: key j visible to query i (Note [Decode attention])."""
    cols = jnp.arange(s)[None, None, None, :]
    limit = lengths[:, None, None, None]
    if causal:
        limit = limit - sq + 1 + jnp.arange(sq)[None, None, :, None]
    return jnp.broadcast_to(cols < limit, (lengths.shape[0], 1, sq, s))


def decode_attention_reference(q, k, v, lengths=None, mask=None, *, causal=True, scale=None):
    """The jnp reference of :func:`decode_attention`: the (Sq, S_max) scores in f32."""
    b, _, sq, _ = q.shape
    s = k.shape[2]
    lengths = _lengths("decode_attention_reference", lengths, b, s)
    bias = jnp.where(_visible(lengths, sq, s, causal), 0.0, -jnp.inf)
    if mask is not None:
        bias = bias + additive_mask(mask).astype(jnp.float32)
    filled = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :, None]
    v = jnp.where(filled, v, jnp.zeros((), v.dtype))
    return attention_reference(q, k, v, bias, scale=scale)


def paged_decode_attention_reference(
    q, k_pages, v_pages, page_table, lengths, *, causal=True, scale=None
):
    """The jnp reference of :func:`paged_decode_attention`: the pages gathered into a
    contiguous (B, Hkv, pages_per_seq * page_size, D) cache, then
    :func:`decode_attention_reference`."""

    def gather(pages):
        g = pages[jnp.clip(jnp.asarray(page_table), 0, pages.shape[0] - 1)]  # (B, P, Hkv, n, D)
        b, p, h, n, d = g.shape
        return g.transpose(0, 2, 1, 3, 4).reshape(b, h, p * n, d)

    return decode_attention_reference(
        q, gather(k_pages), gather(v_pages), lengths, causal=causal, scale=scale
    )
