"""Block-size table and per-program memory (Note [Kernel platforms]): at production sizes
one program of every kernel fits 16 MiB (a TPU v5e core's default scoped VMEM), with the
v5e and the v6e blocks."""

import jax
import jax.numpy as jnp
import pytest

from torchjax.pallas import _ragged, _tiling, kernels
from torchjax.pallas._tiling import VMEM_BUDGET, fit_block, program_memory

BF16 = jnp.bfloat16


def test_fit_block_divides_or_spans():
    assert fit_block(32768, 512, 128) == 512
    assert fit_block(384, 512, 128) == 384  # smaller than the block: the whole dim
    assert fit_block(1536, 1024, 128) == 512
    assert fit_block(1040, 512, 128) == 1040  # no multiple of 128 divides it: whole dim
    assert fit_block(48, 128, 16, whole=False) == 16  # Triton: powers of two only


def test_program_memory_counts_double_buffered_tiles():
    # One (8, 128) f32 input and output, double-buffered: 4 tiles of 4 KiB; a (16, 1) bf16
    # scratch pads to one (16, 128) tile.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, o_ref, s_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_shapes=[pltpu.VMEM((16, 1), BF16)],
            interpret=True,
            name="copy",
        )(x)

    assert program_memory(fn, jax.ShapeDtypeStruct((8, 128), jnp.float32)) == {
        "copy": 4 * 8 * 128 * 4 + 16 * 128 * 2
    }


@pytest.fixture(params=["tpu_v5e", "tpu_v6e"])
def tpu_blocks(request, monkeypatch):
    """The TPU form with one TPU row of the block table."""
    monkeypatch.setattr(_tiling, "platform", lambda interpret: "tpu")
    monkeypatch.setattr(_tiling, "_table_row", lambda plat: _tiling.BLOCKS[request.param])


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool-mask"])
def test_flash_attention_at_32k_fits_vmem(masked, tpu_blocks):
    s = 32768
    q = jax.ShapeDtypeStruct((1, 8, s, 128), BF16)
    kv = jax.ShapeDtypeStruct((1, 2, s, 128), BF16)
    mask = [jax.ShapeDtypeStruct((1, 1, s, s), jnp.bool_)] if masked else []

    def loss(q, k, v, *m):
        out = kernels.flash_attention(q, k, v, *m, causal=not masked, interpret=False)
        return out.astype(jnp.float32).sum()

    memory = program_memory(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, *mask)
    assert set(memory) == {f"torchjax_flash_attention_{n}" for n in ("fwd", "dq", "dkv")}
    assert max(memory.values()) < VMEM_BUDGET, memory


@pytest.mark.parametrize(
    "k, n, transpose_rhs", [(4096, 2816, False), (1408, 4096, True)], ids=["up", "down"]
)
def test_ragged_dot_64_experts_d_model_4096_fits_vmem(k, n, transpose_rhs, tpu_blocks, monkeypatch):
    # Every part in the kernels (in bfloat16 on TPU the forward and drhs are XLA's, Note
    # [Ragged dot parts by platform]; float32 and other platforms run all three).
    monkeypatch.setitem(_ragged.XLA_PARTS, "tpu", frozenset())
    lhs = jax.ShapeDtypeStruct((16384, k), BF16)
    rhs = jax.ShapeDtypeStruct((64, n, k) if transpose_rhs else (64, k, n), BF16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)

    def loss(a, b, s):
        out = kernels.ragged_dot(a, b, s, transpose_rhs=transpose_rhs, interpret=False)
        return out.astype(jnp.float32).sum()

    memory = program_memory(jax.grad(loss, argnums=(0, 1)), lhs, rhs, sizes)
    assert set(memory) == {"torchjax_ragged_dot", "torchjax_ragged_dot_tgmm"}
    assert max(memory.values()) < VMEM_BUDGET, memory


@pytest.mark.parametrize("sq, masked", [(1, False), (16, True)], ids=["sq1", "sq16-mask"])
def test_decode_attention_at_32k_fits_vmem(sq, masked, tpu_blocks):
    # S_max = 32K, D = 128, GQA 8 query heads per kv head: R = 8 * Sq rows per program.
    s = 32768
    q = jax.ShapeDtypeStruct((2, 32, sq, 128), BF16)
    kv = jax.ShapeDtypeStruct((2, 4, s, 128), BF16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    mask = [jax.ShapeDtypeStruct((2, 32, sq, s), jnp.bool_)] if masked else []

    def fn(q, k, v, n, *m):
        return kernels.decode_attention(q, k, v, n, *m, interpret=False)

    memory = program_memory(fn, q, kv, kv, lengths, *mask)
    assert set(memory) == {"torchjax_decode_attention"}
    assert max(memory.values()) < VMEM_BUDGET, memory


def test_paged_decode_attention_fits_vmem(tpu_blocks):
    pages = jax.ShapeDtypeStruct((2048, 8, 256, 128), BF16)
    q = jax.ShapeDtypeStruct((4, 64, 16, 128), BF16)
    table = jax.ShapeDtypeStruct((4, 128), jnp.int32)  # 32K positions per sequence
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = lambda *a: kernels.paged_decode_attention(*a, interpret=False)  # noqa: E731
    memory = program_memory(fn, q, pages, pages, table, lengths)
    assert set(memory) == {"torchjax_paged_decode_attention"}
    assert max(memory.values()) < VMEM_BUDGET, memory


def test_flash_blocks_without_a_mask_come_from_the_chips_measured_table(monkeypatch):
    monkeypatch.setattr(_tiling, "_table_name", lambda plat: "tpu_v5e")
    measured = _tiling.FLASH_UNMASKED["tpu_v5e"]
    table = (_tiling.BLOCKS["tpu_v5e"]["flash_fwd"], _tiling.BLOCKS["tpu_v5e"]["flash_bwd"])
    assert measured and measured[128] != table
    for d, blocks in measured.items():
        assert _tiling.flash_blocks("tpu", d, masked=False) == blocks
        assert _tiling.flash_blocks("tpu", d, masked=True) == table
    assert _tiling.flash_blocks("tpu", 256, masked=False) == table  # not measured


@pytest.mark.parametrize(
    "mask, dtype",
    [(None, BF16), (jnp.bool_, BF16), (BF16, BF16), (jnp.float32, BF16), (None, jnp.float32)],
)
def test_flash_blocks_fit_vmem_at_every_measured_head_dim(monkeypatch, mask, dtype):
    monkeypatch.setattr(_tiling, "platform", lambda interpret: "tpu")
    monkeypatch.setattr(_tiling, "_table_name", lambda plat: "tpu_v5e")
    from torchjax.pallas import _flash, kernels

    seen = []
    blocks = _flash._blocks
    monkeypatch.setattr(_flash, "_blocks", lambda *a: seen.append(blocks(*a)) or seen[-1])
    for d in _tiling.FLASH_UNMASKED["tpu_v5e"]:
        q = jax.ShapeDtypeStruct((1, 8, 8192, d), dtype)
        kv = jax.ShapeDtypeStruct((1, 2, 8192, d), dtype)
        masks = [] if mask is None else [jax.ShapeDtypeStruct((1, 1, 8192, 8192), mask)]

        def loss(q, k, v, *m):
            out = kernels.flash_attention(q, k, v, *m, causal=mask is None)
            return out.astype(jnp.float32).sum()

        memory = program_memory(jax.grad(loss, (0, 1, 2)), q, kv, kv, *masks)
        assert len(memory) == 3, memory  # forward, dq, dkv
        assert max(memory.values()) < VMEM_BUDGET, memory
        # a boolean or bfloat16 mask takes the measured blocks; a float32 one, or float32
        # inputs, the table's (Note [Flash blocks by input width])
        measured = tuple(x for pair in _tiling.FLASH_UNMASKED["tpu_v5e"][d] for x in pair)
        narrow = mask != jnp.float32 and dtype == BF16
        assert (seen[-1] == measured) == narrow, (seen[-1], mask, dtype)
