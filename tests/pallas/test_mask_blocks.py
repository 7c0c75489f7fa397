"""Flash attention with a mask's block map (Note [Mask block map]): tiles wholly masked
are skipped, wholly visible ones run without reading the mask, the rest read it; values
and gradients equal the jnp reference and the plain path's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas.tolerance import F32_VS_REFERENCE_ATOL
from torchjax.pallas import _flash, _mask_blocks, kernels

B, HQ, HKV, S, D, BLOCK = 3, 4, 2, 256, 16, 128
_RNG = np.random.default_rng(3)
LENGTHS = (S, 150, BLOCK)  # a full row, a row cut inside a key block, one at a block edge


def _padding(heads=1):
    valid = np.arange(S)[None, None, None, :] < np.asarray(LENGTHS)[:, None, None, None]
    if heads > 1:  # per-head masks: each head sees a different prefix
        cut = np.arange(heads)[None, :, None, None] * 20
        valid = valid & (np.arange(S)[None, None, None, :] < S - cut)
    return np.broadcast_to(valid, (B, heads, S, S)).copy()


def _causal_padded(heads=1):
    m = _padding(heads) & np.tril(np.ones((S, S), bool))
    m[2, :, 10] = False  # a query row with every key masked: zeros, as torch
    return m


CASES = {
    "causal-and-padding-mask": (lambda: _causal_padded(), False),
    "padding-mask-with-causal": (lambda: _padding(), True),
    "per-head-mask": (lambda: _causal_padded(HQ), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_map_matches_reference_forward_and_grad(case):
    make, causal = CASES[case]
    mask = jnp.asarray(make())
    codes = set(
        np.asarray(_mask_blocks.block_map(_flash.additive_mask(mask), causal, BLOCK, BLOCK)) & 3
    )
    assert codes == {0, 1, 2}, codes  # every kind of tile is exercised
    q = jnp.asarray(_RNG.standard_normal((B, HQ, S, D)), jnp.float32)
    k, v = (jnp.asarray(_RNG.standard_normal((B, HKV, S, D)), jnp.float32) for _ in range(2))
    ct = jnp.asarray(_RNG.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        def f(*a):
            out = fn(*a, mask, causal=causal)
            return jnp.sum(out * ct), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    def flash(*a, **kw):
        return kernels.flash_attention(*a, block_q=BLOCK, block_k=BLOCK, **kw)

    (_, out), grads = loss(flash)(q, k, v)
    (_, ref), ref_grads = loss(kernels.attention_reference)(q, k, v)
    assert jnp.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert jnp.allclose(g, r, atol=F32_VS_REFERENCE_ATOL), float(jnp.abs(g - r).max())
    if not causal:  # the row with every key masked is zero, as torch's
        assert float(jnp.abs(out[2, :, 10]).max()) == 0.0


def test_plain_path_where_the_map_does_not_apply(monkeypatch):
    mask = jnp.asarray(_causal_padded())
    q = jnp.asarray(_RNG.standard_normal((B, HQ, S, D)), jnp.float32)
    k, v = (jnp.asarray(_RNG.standard_normal((B, HKV, S, D)), jnp.float32) for _ in range(2))

    def run():
        fn = lambda *a: jnp.sum(kernels.flash_attention(*a, mask, block_q=BLOCK, block_k=BLOCK))  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(q, k, v)

    mapped = run()
    monkeypatch.setattr(_mask_blocks, "MAX_TILES", 0)
    assert not _mask_blocks.applies(_flash.additive_mask(mask), BLOCK, BLOCK)
    plain = run()
    for a, b in zip(jax.tree_util.tree_leaves(mapped), jax.tree_util.tree_leaves(plain)):
        assert jnp.allclose(a, b, atol=1e-5)


def test_map_size_bound():
    big = jax.ShapeDtypeStruct((64, 1, 8192, 8192), jnp.float32)
    assert not _mask_blocks.applies(big, 128, 128)  # 262,144 tiles: the plain path
    assert _mask_blocks.applies(jax.ShapeDtypeStruct((8, 1, 8192, 8192), jnp.float32), 512, 512)
    assert not _mask_blocks.applies(None, 128, 128)


def test_nearest_fetch_index():
    need = jnp.asarray([[False, True, False, False, True], [False] * 5])
    got = np.asarray(_mask_blocks._nearest(need))
    # before the first needed block: the first one (fetched early); after: the last one
    assert got.tolist() == [[1, 1, 1, 1, 4], [0, 0, 0, 0, 0]]
