"""The kernels lower for GPU (Triton) and TPU (Mosaic) without either: jax's
cross-platform lowering (``.lower(lowering_platforms=...)``) runs Pallas' Triton and
Mosaic lowerings in Python, so block-shape rules (TPU: last two block dims divisible by
(8, 128) or full), dtype and primitive support errors show up on CPU. Mosaic reads the
chip from the abstract mesh's device (a TPU v5e here). What the platform compilers do
afterwards (PTX, libtpu) is not covered."""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from torchjax.pallas import _tiling, kernels

BF16 = jnp.bfloat16
_TPU = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="TPU v5 lite", num_cores=1, platform="tpu"
    ),
)


@pytest.fixture(params=["cuda", "tpu"])
def platform(request, monkeypatch):
    if request.param == "cuda":
        # What platform() says when jax's default backend is a GPU.
        monkeypatch.setattr(_tiling, "platform", lambda interpret: "gpu")
    return request.param


def _lower(platform, fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    with jax.sharding.use_abstract_mesh(_TPU) if platform == "tpu" else contextlib.nullcontext():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool-mask"])
def test_flash_attention_forward_and_backward_lower(platform, masked):
    # Production shapes: several blocks of the platform's default sizes per sequence, GQA.
    def loss(q, k, v, *mask):
        out = kernels.flash_attention(q, k, v, *mask, causal=not masked, interpret=False)
        return out.astype(jnp.float32).sum()

    q, kv = ((1, 4, 2048, 128), BF16), ((1, 2, 2048, 128), BF16)
    mask = [((1, 1, 2048, 2048), jnp.bool_)] if masked else []
    text = _lower(platform, jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, *mask)
    for name in ("fwd", "dq", "dkv"):
        assert f"torchjax_flash_attention_{name}" in text


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["gkn", "gnk"])
def test_ragged_dot_forward_and_backward_lower(platform, transpose_rhs):
    # Production blocks: several m, k and n tiles, 64 experts.
    def loss(lhs, rhs, sizes):
        out = kernels.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs, interpret=False)
        return out.astype(jnp.float32).sum()

    rhs = (64, 2048, 1024) if transpose_rhs else (64, 1024, 2048)
    text = _lower(
        platform,
        jax.grad(loss, argnums=(0, 1)),
        ((2048, 1024), BF16),
        (rhs, BF16),
        ((64,), jnp.int32),
    )
    assert "torchjax_ragged_dot" in text and "torchjax_ragged_dot_tgmm" in text


@pytest.mark.parametrize("sq, masked", [(1, False), (4, True)], ids=["sq1", "sq4-bool-mask"])
def test_decode_attention_lowers(platform, sq, masked):
    # Production shapes: a 32K cache in several key blocks of the platform's default,
    # GQA 32 query heads over 8 kv heads, per-batch lengths.
    def fn(q, k, v, lengths, *mask):
        return kernels.decode_attention(q, k, v, lengths, *mask, interpret=False)

    b, s = 4, 32768
    mask = [((b, 1, sq, s), jnp.bool_)] if masked else []
    kv = ((b, 8, s, 128), BF16)
    text = _lower(platform, fn, ((b, 32, sq, 128), BF16), kv, kv, ((b,), jnp.int32), *mask)
    assert "torchjax_decode_attention" in text


@pytest.mark.parametrize("sq", [1, 8])
def test_paged_decode_attention_lowers(platform, sq):
    # 128-token pages, 64 per sequence (8K positions), a pool of 1024 pages.
    def fn(q, k, v, table, lengths):
        return kernels.paged_decode_attention(q, k, v, table, lengths, interpret=False)

    pages = ((1024, 8, 128, 128), BF16)
    text = _lower(
        platform,
        fn,
        ((4, 32, sq, 128), BF16),
        pages,
        pages,
        ((4, 64), jnp.int32),
        ((4,), jnp.int32),
    )
    assert "torchjax_paged_decode_attention" in text
