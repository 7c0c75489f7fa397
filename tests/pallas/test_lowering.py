"""The kernels lower for GPU (Triton) and TPU (Mosaic) without either: jax's
cross-platform lowering (``.lower(lowering_platforms=...)``) runs Pallas' Triton and
Mosaic lowerings in Python, so block-shape rules (TPU: last two block dims divisible by
(8, 128) or full), dtype and primitive support errors show up on CPU. Mosaic reads the
chip from the abstract mesh's device (a TPU v5e here). What the platform compilers do
afterwards (PTX, libtpu) is not covered.

torchjax calls the kernels with JAX's x64 on (every op runs so), and Mosaic has no 64-bit
types: each TPU lowering here runs under x64 and reads the Mosaic modules back, which must
hold no 64-bit integer or float (Note [Kernels trace in 32-bit mode]). Before the kernels
traced in 32-bit mode, every index map returned an i64 there and libtpu refused them all."""

import re

import jax
import jax.numpy as jnp
import pytest

from tests.pallas import user_kernel
from torchjax import pallas as tp
from torchjax._compat.jax import mosaic_modules
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
    return request.param


_WIDE = re.compile(r"\b(i64|ui64|si64|f64)\b")
# Attributes (``stable_mosaic.version = 11 : i64``, ``iteration_bounds = array<i64: 1, 4>``)
# are typed i64 in MLIR; the kernel's values are not.
_ATTRIBUTE = re.compile(r"= -?\d+ : i64\b|array<i64")


def _lower(platform, fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    if platform != "tpu":
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    with jax.sharding.use_abstract_mesh(_TPU), jax.enable_x64(True):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    modules = mosaic_modules(text)
    assert modules, "no Mosaic kernel in the TPU lowering"
    for module in modules:
        wide = sorted({m.group(1) for m in _WIDE.finditer(_ATTRIBUTE.sub("", module))})
        assert not wide, f"64-bit types {wide} in a Mosaic kernel:\n{module[:3000]}"
    return text


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


@pytest.mark.parametrize("dtype", [BF16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["gkn", "gnk"])
def test_ragged_dot_forward_and_backward_lower(platform, transpose_rhs, dtype):
    # Production blocks: several m, k and n tiles, 64 experts.
    def loss(lhs, rhs, sizes):
        out = kernels.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs, interpret=False)
        return out.astype(jnp.float32).sum()

    rhs = (64, 2048, 1024) if transpose_rhs else (64, 1024, 2048)
    text = _lower(
        platform,
        jax.grad(loss, argnums=(0, 1)),
        ((2048, 1024), dtype),
        (rhs, dtype),
        ((64,), jnp.int32),
    )
    kernels_named = set(re.findall(r"torchjax_ragged_dot\w*", text))
    # Note [Ragged dot parts by platform]: XLA's forward and drhs in half precision on TPU.
    xla = _ragged.XLA_PARTS.get(platform, ()) if dtype == BF16 else ()
    want = {"torchjax_ragged_dot"} | (set() if "drhs" in xla else {"torchjax_ragged_dot_tgmm"})
    assert kernels_named == want  # dlhs always the kernel's
    assert ("chlo.ragged_dot" in text) == bool(xla)


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


# Lowered for TPU here, never run: the kernel compiles for the chip, not interpreted.
_user_kernel = user_kernel.identity(interpret=False)


@tp.op("torchjax_test::user_grid_kernel")
def _user_op(x):
    return _user_kernel(x)


def test_a_users_kernel_op_lowers_in_32_bit_mode_forward_and_backward():
    # What the op runs (its function in 32-bit mode, Note [A kernel op's JAX mode]), under
    # torchjax's x64 and differentiated from outside as torch.compile training does.
    def loss(f):
        return lambda x: f(x).sum()

    x = ((64, 128), jnp.float32)
    text = _lower("tpu", jax.grad(loss(_user_op._fn)), x)
    assert len(mosaic_modules(text)) == 2  # forward and backward kernels
    # The function as written, traced with x64 on, is what Mosaic refused.
    with pytest.raises(AssertionError, match=r"64-bit types \['i64'\]"):
        _lower("tpu", jax.grad(loss(_user_op.fn)), x)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
def test_float32_kernel_products_are_full_precision(dtype):
    # Note [Kernel matmul precision]: Mosaic's default for float32 is one bfloat16 pass.
    def loss(q, k, v, lhs, rhs, sizes):
        att = kernels.flash_attention(q, k, v, causal=True, interpret=False)
        mm = kernels.ragged_dot(lhs, rhs, sizes, interpret=False)
        return att.astype(jnp.float32).sum() + mm.astype(jnp.float32).sum()

    qkv = ((1, 2, 256, 128), dtype)
    text = _lower(
        "tpu",
        jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
        *[qkv] * 3,
        ((512, 256), dtype),
        ((4, 256, 256), dtype),
        ((4,), jnp.int32),
    )
    modules = mosaic_modules(text)
    # flash fwd, dq, dkv; ragged fwd, dlhs, drhs (in bfloat16 the ragged forward and drhs
    # are XLA's: Note [Ragged dot parts by platform])
    assert len(modules) == (6 if dtype == jnp.float32 else 4)
    for module in modules:
        matmuls = [line for line in module.splitlines() if "tpu.matmul" in line]
        assert matmuls
        full = ["contract_precision<fp32>" in line for line in matmuls]
        assert all(full) if dtype == jnp.float32 else not any(full)
