"""Which tiles of a masked flash attention call the kernels compute, and what they fetch.

Note [Mask block map]
A mask from a model (causal plus key padding, the (B, 1, S, S) mask transformers passes)
is constant over most tiles: a (query block, key block) tile is either wholly masked
(above the diagonal, or past a row's last key) or wholly visible. Reading such a tile's
mask from HBM, and computing a wholly masked tile, is wasted work: at (4, 16, 2048, 128)
the float32 mask is 64 MiB, read once per query head. Before the kernels run, one pass
over the mask gives each tile a code:

- 0: every entry -inf (or above the causal diagonal): the tile is skipped, since it
  would leave the running max, sum and accumulator (forward) and add zero (backward);
- 1: every entry 0: the tile runs without reading its mask;
- 2: anything else: the tile reads its mask, as without the map.

Each code is packed with the block indices the pipeline should fetch at that grid step:
the operands of the walked dimension (key/value blocks for the forward and ``dq``,
query-side blocks for ``dk``/``dv``) at the nearest tile at or before it that runs (the
first that runs when none before it does), and the mask at the nearest tile that reads
it. A step whose index equals the previous step's fetches nothing (the TPU pipeline
compares block indices), so a skipped tile costs neither HBM reads nor compute, and a
visible one no mask read. The table reaches the kernels by scalar prefetch into SMEM,
one int32 per tile: ``code | fetch << 2 | mask_fetch << 16``. Masks with more tiles than
:data:`MAX_TILES` (or 2**14 blocks a side) keep the plain path, which reads every
tile's mask (SMEM is small).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

MAX_TILES = 2**14
_SIDE = 2**14


def applies(mask, block_q: int, block_k: int) -> bool:
    """Whether a block map is built for ``mask`` (4-D, additive) at these blocks."""
    if mask is None:
        return False
    nq, nk = mask.shape[2] // block_q, mask.shape[3] // block_k
    return mask.shape[0] * mask.shape[1] * nq * nk <= MAX_TILES and max(nq, nk) < _SIDE


def _codes(mask, causal, block_q, block_k):
    """(MB, MH, nq, nk) int32 tile codes of an additive mask (MB, MH, Sq, Sk)."""
    mb, mh, sq, sk = mask.shape
    nq, nk = sq // block_q, sk // block_k
    tiles = mask.reshape(mb, mh, nq, block_q, nk, block_k)
    dead = jnp.all(tiles == -jnp.inf, axis=(3, 5))
    clear = jnp.all(tiles == 0, axis=(3, 5))
    code = jnp.where(dead, 0, jnp.where(clear, 1, 2)).astype(jnp.int32)
    if causal:
        i = jnp.arange(nq)[:, None]
        j = jnp.arange(nk)[None, :]
        code = jnp.where(j * block_k > (i + 1) * block_q - 1, 0, code)
    return code


def _nearest(need):
    """For each position of the last axis, the nearest index at or before it where
    ``need`` holds, else the first where it does (0 when none does)."""
    n = need.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), need.shape)
    last = lax.cummax(jnp.where(need, idx, -1), axis=need.ndim - 1)
    first = jnp.argmax(need, axis=-1, keepdims=True).astype(jnp.int32)
    return jnp.where(last >= 0, last, first)


def block_map(mask, causal: bool, block_q: int, block_k: int, by_key: bool = False):
    """The packed tile table (flat int32) of Note [Mask block map] for an additive mask
    (MB, MH, Sq, Sk). Ordered (MB, MH, query block, key block), the key block walked;
    with ``by_key``, (MB, MH, key block, query block), the query block walked (the
    ``dk``/``dv`` kernel's order)."""
    code = _codes(mask, causal, block_q, block_k)
    if by_key:
        code = jnp.swapaxes(code, 2, 3)
    fetch = _nearest(code != 0)
    mask_fetch = _nearest(code == 2)
    return (code | (fetch << 2) | (mask_fetch << 16)).reshape(-1)


class Tiles:
    """A mask's block map at one pair of block sizes: the table (prefetched into the
    kernel) and its lookups, by the grid's (batch, head, held block, walked block)."""

    def __init__(self, table, mask_shape, n_outer: int, n_inner: int):
        self.table = table
        self._shape = mask_shape
        self._n = (n_outer, n_inner)

    @classmethod
    def of(cls, mask, causal: bool, block_q: int, block_k: int, by_key: bool = False):
        """The map for an additive mask (None without a mask or where it does not apply);
        ``by_key``: held key blocks, walked query blocks."""
        if not applies(mask, block_q, block_k):
            return None
        nq, nk = mask.shape[2] // block_q, mask.shape[3] // block_k
        n = (nk, nq) if by_key else (nq, nk)
        return cls(block_map(mask, causal, block_q, block_k, by_key), mask.shape, *n)

    def _entry(self, table, b, h, outer, inner):
        mb, mh = self._shape[0] > 1, self._shape[1] > 1
        b, h = (b if mb else 0), (h if mh else 0)
        return table[((b * self._shape[1] + h) * self._n[0] + outer) * self._n[1] + inner]

    def code(self, table, b, h, outer, inner):
        """0 skip, 1 run without the mask, 2 run with it."""
        return self._entry(table, b, h, outer, inner) & 3

    def fetch(self, table, b, h, outer, inner):
        """The walked operands' block to fetch at this step."""
        return (self._entry(table, b, h, outer, inner) >> 2) & (_SIDE - 1)

    def mask_fetch(self, table, b, h, outer, inner):
        """The mask's walked block to fetch at this step."""
        return self._entry(table, b, h, outer, inner) >> 16
