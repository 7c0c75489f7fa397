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
from jax.experimental.pallas import triton as pltriton

from torchjax.pallas import _ragged, _tiling, kernels

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
        for module in (_ragged,):
            monkeypatch.setattr(module, "compiler_params", pltriton.CompilerParams)
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


def test_ragged_dot_forward_and_backward_lower(platform):
    def loss(lhs, rhs, sizes):
        return kernels.ragged_dot(lhs, rhs, sizes, interpret=False).astype(jnp.float32).sum()

    text = _lower(
        platform,
        jax.grad(loss, argnums=(0, 1)),
        ((128, 128), BF16),
        ((8, 128, 256), BF16),
        ((8,), jnp.int32),
    )
    assert "torchjax_ragged_dot" in text and "torchjax_ragged_dot_tgmm" in text
