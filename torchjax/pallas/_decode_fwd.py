"""Decode attention kernels: a contiguous or paged KV cache, grid and loop forms.

Every form runs one program per (batch, kv head) over the ``R = group * Sq`` query rows of
that kv head (torchjax/pallas/_decode.py lays them out), walking the cache's key blocks
(a contiguous block of ``block_k`` positions, or one page) with the online softmax of
torchjax/pallas/_flash_fwd.py:

- grid form (TPU, interpret): grid ``(B, Hkv, key blocks)``, the last dimension
  "arbitrary", the running max, sum and f32 accumulator in scratch. ``lengths`` and
  ``ends`` (and the page table) come by scalar prefetch (``pltpu.PrefetchScalarGridSpec``),
  so the key/value index maps read them: a key block at or past ``ends[b]`` keeps the
  index of the last useful block (the pipeline sees the same block again and fetches
  nothing) and its body is skipped under ``pl.when``. For a paged cache the index map
  reads the block's page from the table.
- loop form (GPU/Triton: no scratch, no scalar prefetch): grid ``(B, Hkv)``; lengths,
  ends and the table row are ordinary inputs, and a ``fori_loop`` runs over the
  ``cdiv(ends[b], block_k)`` useful blocks only, loading each tile with ``pl.ds`` (or the
  page given by the table) from a block spanning the cache.

Per key tile (``_tile``): scores in f32, the additive mask added, key positions at or past
the row's limit set to -inf (``lengths[b]``, or with ``causal`` ``lengths[b] - Sq + 1 + i``
for query ``i``, the row's ``r % Sq``), and value rows at or past ``lengths[b]`` zeroed,
so stale cache entries (a reused page, NaN included) never reach the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas._flash_fwd import F32, dot, fwd_finish, softmax_step
from torchjax.pallas._tiling import compiler_params, pallas_call, scratch


def _tile(q, k, v, bias, length, start, *, scale, causal, sq):
    """Masked f32 scores of the query rows against one key tile starting at ``start``,
    and the tile's value rows with positions past ``length`` zeroed."""
    rows, block_k = q.shape[0], k.shape[0]
    s = dot(q, k, trans_b=True) * scale
    if bias is not None:
        s = s + bias.astype(F32)
    cols = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    limit = length
    if causal:
        limit = length - sq + 1
        if sq > 1:
            limit = limit + lax.rem(
                lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), jnp.int32(sq)
            )
    s = jnp.where(cols < limit, s, -jnp.inf)
    keys = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    v = jnp.where(keys < length, v, jnp.zeros((), v.dtype))
    return s, v


def last_block(ends, b, block_k):
    """The last key block holding a position before ``ends[b]`` (0 when none does)."""
    return jnp.maximum((ends[b] + block_k - 1) // block_k - 1, 0)


def _grid_kernel(*refs, scale, causal, sq, block_k, paged, has_mask):
    lengths, ends = refs[:2]
    q_ref, k_ref, v_ref = refs[3:6] if paged else refs[2:5]
    mask_ref = refs[-5] if has_mask else None
    o_ref, m_sc, l_sc, acc_sc = refs[-4:]
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(j * block_k < ends[b])
    def _step():
        bias = None if mask_ref is None else mask_ref[...]
        s, v = _tile(
            q_ref[...],
            k_ref[...],
            v_ref[...],
            bias,
            lengths[b],
            j * block_k,
            scale=scale,
            causal=causal,
            sq=sq,
        )
        m_sc[...], l_sc[...], acc_sc[...] = softmax_step(s, v, m_sc[...], l_sc[...], acc_sc[...])

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = fwd_finish(m_sc[...], l_sc[...], acc_sc[...])[0].astype(o_ref.dtype)


def grid_forward(q, cache, mask, lengths, ends, *, causal, scale, sq, block_k, interpret, plat):
    """The grid form; ``cache`` is ``(k, v)`` (B, Hkv, S, D) or ``(k_pages, v_pages,
    table)`` with pages (P, Hkv, page, D) and ``block_k`` the page size."""
    from jax.experimental.pallas import tpu as pltpu

    b, hkv, rows, d = q.shape
    paged = len(cache) == 3
    dv = cache[1].shape[-1]
    if paged:
        n_pages, steps = cache[0].shape[0], cache[2].shape[1]

        def kv(b_, h, j, lens, ends_, table):
            page = table[b_, jnp.minimum(j, last_block(ends_, b_, block_k))]
            return (jnp.clip(page, 0, n_pages - 1), h, 0, 0)

        prefetch = (lengths, ends, cache[2])
    else:
        steps = cache[0].shape[2] // block_k

        def kv(b_, h, j, lens, ends_):
            return (b_, h, jnp.minimum(j, last_block(ends_, b_, block_k)), 0)

        prefetch = (lengths, ends)
    row = lambda b_, h, j, *_: (b_, h, 0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, rows, d), row),
        pl.BlockSpec((None, None, block_k, d), kv),
        pl.BlockSpec((None, None, block_k, dv), kv),
    ]
    args = [q, *cache[:2]]
    if mask is not None:
        mb, mh = mask.shape[0] > 1, mask.shape[1] > 1

        def mask_map(b_, h, j, lens, ends_, *table):
            return (
                b_ if mb else 0,
                h if mh else 0,
                0,
                jnp.minimum(j, last_block(ends_, b_, block_k)),
            )

        in_specs.append(pl.BlockSpec((None, None, mask.shape[2], block_k), mask_map))
        args.append(mask)
    kernel = functools.partial(
        _grid_kernel,
        scale=scale,
        causal=causal,
        sq=sq,
        block_k=block_k,
        paged=paged,
        has_mask=mask is not None,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(b, hkv, steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rows, dv), row),
        scratch_shapes=[
            scratch(plat, (rows, 1), F32),
            scratch(plat, (rows, 1), F32),
            scratch(plat, (rows, dv), F32),
        ],
    )
    return pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, rows, dv), q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat, ("parallel", "parallel", "arbitrary")),
        name="torchjax_paged_decode_attention" if paged else "torchjax_decode_attention",
    )(*prefetch, *args)


def _loop_kernel(*refs, scale, causal, sq, block_k, paged, has_mask):
    len_ref, end_ref = refs[:2]
    table_ref = refs[2] if paged else None
    q_ref, k_ref, v_ref = refs[3:6] if paged else refs[2:5]
    mask_ref = refs[-2] if has_mask else None
    o_ref = refs[-1]
    length, end = len_ref[...], end_ref[...]
    q = q_ref[...]

    def body(j, carry):
        start = j * block_k
        if paged:
            page = table_ref[j]
            k, v = k_ref[page], v_ref[page]
        else:
            cols = pl.ds(pl.multiple_of(start, block_k), block_k)
            k, v = k_ref[cols, :], v_ref[cols, :]
        bias = None
        if mask_ref is not None:
            bias = mask_ref[:, pl.ds(pl.multiple_of(start, block_k), block_k)]
        s, v = _tile(q, k, v, bias, length, start, scale=scale, causal=causal, sq=sq)
        return softmax_step(s, v, *carry)

    init = (
        jnp.full((q.shape[0], 1), -jnp.inf, F32),
        jnp.zeros((q.shape[0], 1), F32),
        jnp.zeros((q.shape[0], o_ref.shape[-1]), F32),
    )
    n_blocks = (end + block_k - 1) // block_k
    o_ref[...] = fwd_finish(*lax.fori_loop(0, n_blocks, body, init))[0].astype(o_ref.dtype)


def loop_forward(q, cache, mask, lengths, ends, *, causal, scale, sq, block_k, interpret, plat):
    """The loop form (GPU); arguments as :func:`grid_forward`."""
    b, hkv, rows, d = q.shape
    paged = len(cache) == 3
    dv = cache[1].shape[-1]
    scalar = pl.BlockSpec((None,), lambda b_, h: (b_,))
    in_specs, args = [scalar, scalar], [lengths, ends]
    if paged:
        n_pages, page, steps = cache[0].shape[0], cache[0].shape[2], cache[2].shape[1]
        in_specs.append(pl.BlockSpec((None, steps), lambda b_, h: (b_, 0)))
        args.append(cache[2])
        kv = [pl.BlockSpec((n_pages, None, page, dd), lambda b_, h: (0, h, 0, 0)) for dd in (d, dv)]
    else:
        s_max = cache[0].shape[2]
        kv = [pl.BlockSpec((None, None, s_max, dd), lambda b_, h: (b_, h, 0, 0)) for dd in (d, dv)]
    in_specs += [pl.BlockSpec((None, None, rows, d), lambda b_, h: (b_, h, 0, 0)), *kv]
    args += [q, *cache[:2]]
    if mask is not None:
        mb, mh = mask.shape[0] > 1, mask.shape[1] > 1
        in_specs.append(
            pl.BlockSpec(
                (None, None, *mask.shape[2:]),
                lambda b_, h: (b_ if mb else 0, h if mh else 0, 0, 0),
            )
        )
        args.append(mask)
    kernel = functools.partial(
        _loop_kernel,
        scale=scale,
        causal=causal,
        sq=sq,
        block_k=block_k,
        paged=paged,
        has_mask=mask is not None,
    )
    return pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rows, dv), lambda b_, h: (b_, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, rows, dv), q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_paged_decode_attention" if paged else "torchjax_decode_attention",
    )(*args)
