"""Where a kernel runs, its block sizes there, and what one program holds in memory.

Note [Kernel platforms]
A Pallas call is compiled for one of three targets, and the kernels differ between them:

- "tpu" (Mosaic): the grid runs sequentially on a core; every blocked operand is copied
  from HBM into VMEM by a pipeline that double-buffers it (the next block is fetched while
  the current one is used), and scratch buffers (``pltpu.VMEM``) live across the grid
  steps of one core. A reduction can therefore be a grid dimension (the innermost,
  ``"arbitrary"``), its running state in scratch. Per-program memory is the sum of the
  blocks (twice each) and the scratch, padded to the (sublane, 128-lane) tiles VMEM is
  laid out in; it must fit the scoped VMEM limit (16 MiB by default on v5e).
- "gpu" (Triton): each grid program is an independent thread block, and jax 0.10.2's
  Triton lowering has neither scratch operands ("scratch memory not implemented in the
  Triton backend") nor scalar prefetch: a reduction cannot span grid steps. There a
  kernel walks its reduction in a ``fori_loop``; a BlockSpec only offsets a pointer into
  global memory and ``ref[pl.ds(...)]`` loads one tile into registers/shared memory, so
  a block spanning the whole sequence costs nothing by itself: per-program memory is
  the tiles loaded, bounded by the block sizes as well.
- "interpret" (CPU): jax's interpreter runs the grid as a loop over the same kernel
  bodies; scratch works there, declared backend-neutrally (``pl.MemorySpace.DEFAULT``).
  Interpret mode runs the TPU form of every kernel (the form with a grid reduction), so
  CPU tests exercise what Mosaic compiles; tests run the GPU form in interpret mode by
  asking for it.

Note [Kernels trace in 32-bit mode]
torchjax runs every op with JAX's x64 on (Note [x64 without touching the user's JAX] in
torchjax/_compat/jax.py), but Mosaic has no 64-bit integers: under x64 a Python ``0``
returned by an index map, or a ``fori_loop`` over Python bounds in a kernel body, becomes
an int64, and libtpu refuses the kernel ("failed to legalize operation 'func.return' ...
(i32, i32, i32, i64)"). Pallas kernels are written for JAX's default 32-bit mode, so
:func:`pallas_call` traces the kernel, its index maps and its grid in that mode, whatever
the caller's setting; the kernels' operands are float arrays and int32 schedules, cast
before the call. The lowering that follows keeps the 32-bit types the trace gave.
tests/pallas/test_lowering.py lowers every kernel for TPU with x64 on and reads the
Mosaic modules back: no 64-bit type in any of them.

The block-size table below gives each platform's defaults. They are starting points
chosen to fit memory (:func:`program_memory`) with MXU/tensor-core friendly shapes, not
tuned: no TPU or GPU has run them yet.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from torchjax._compat.jax import pallas_call_buffers

VMEM_BUDGET = 16 * 2**20

# Per platform and kernel: block sizes (largest wanted; fit_block shrinks them to divide
# the array). Flash: (block_q, block_k) for forward and for both backward kernels.
# Ragged dot: (block_m, block_k, block_n).
# Decode attention: (block_k,), keys per step of a contiguous cache (a paged cache steps
# by its page). Decode reads the cache once: a large block amortises the per-step cost,
# while the skipped tail (Note [Decode attention]) wastes at most one block.
BLOCKS = {
    "tpu_v5e": {
        "flash_fwd": (512, 512),
        "flash_bwd": (256, 512),
        "ragged": (512, 512, 512),
        "decode": (1024,),
    },
    "tpu_v6e": {
        "flash_fwd": (512, 1024),
        "flash_bwd": (512, 512),
        "ragged": (512, 1024, 1024),
        "decode": (2048,),
    },
    "gpu": {
        "flash_fwd": (128, 64),
        "flash_bwd": (64, 64),
        "ragged": (128, 64, 128),
        "decode": (128,),
    },
    # Interpret mode pays per grid step, not per byte: large blocks, few steps.
    "interpret": {
        "flash_fwd": (512, 512),
        "flash_bwd": (512, 512),
        "ragged": (256, 256, 256),
        "decode": (2048,),
    },
}

# Note [Row statistics across lanes]
# The flash kernels carry per-query-row statistics (the running max and sum, the
# backward's shift, ``1 / denom`` and ``delta``). On TPU a (block_q, 1) column fills one
# lane of each (8, 128) vreg, and every use against a (block_q, block_k) tile broadcasts
# it across lanes; held as (block_q, 128) with the value in every lane (as jax's own
# Pallas TPU flash kernel holds them), a use is the same vregs repeated. In HBM a
# trailing dim of 1 is padded to 128 lanes anyway, so the wide arrays cost no memory.
# Measured on a v5e, the forward at (4, 16, 2048, 128) causal bf16, 512 blocks: 2.10 ->
# 1.65 ms; (1, 16/2, 8192, 128) GQA: 5.18 -> 3.54 ms. Triton has no lane layout to
# match: a column there.
STAT_LANES = {"tpu": 128, "interpret": 128, "gpu": 1}

# Flash blocks without a mask (causal or full attention), by head dim: (forward,
# backward) (block_q, block_k), measured on the chip (v5e, bf16, a sweep of block sizes;
# docs/performance.md's attention table): larger blocks there, where no mask block shares
# the VMEM. At
# (4, 32/8, 2048, 64) causal the forward took 2.42 ms at 512 blocks and 2.55 at 1024,
# forward + backward 9.75 ms with the (256, 512) backward and 7.84 with 1024; at
# (4, 16, 2048, 128) the forward 1.52 / 1.50 ms and at (1, 16/2, 8192, 128) 3.46 /
# 3.17 ms. A mask of at most 2 bytes an entry (a boolean mask reaches the kernels as
# bfloat16) takes them too: with the mask block map (Note [Mask block map]) few tiles
# read it, and at (4, 16, 2048, 128) causal + key padding, a (B, 1, S, S) mask, the
# forward took 1.89 ms at the 512 blocks and 1.78 at 1024, forward + backward 6.34 and
# 4.78 ms (jax's flash with segment ids 1.51 / 5.52). Head dims not listed, wider masks
# (float32: a (1024, 1024) tile is 4 MiB, twice over in the pipeline) and other chips
# take BLOCKS.
#
# Note [Flash blocks by input width]
# These blocks hold for q, k and v of 2 bytes an element. With float32 inputs the
# backward's (1024, 1024) dk/dv kernel asked Mosaic for 18.05 MiB of scoped VMEM at
# (1, 8/2, 1024, 128) causal on a v5e (limit 16 MiB) and did not compile (the TPU tier's
# float32 GQA check, where the table's blocks had passed): float32 calls take BLOCKS.
FLASH_UNMASKED = {
    "tpu_v5e": {64: ((512, 512), (1024, 1024)), 128: ((1024, 1024), (1024, 1024))},
}

# Smallest legal step of a block dim per platform: Mosaic wants the last two block dims
# divisible by (8, 128) unless they span the array; Triton wants powers of two.
LANE, SUBLANE = 128, 8


def platform(interpret: bool) -> str:
    """ "interpret", "gpu" or "tpu": the form of a kernel to build (Note [Kernel platforms])."""
    if interpret:
        return "interpret"
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"


def _table_name(plat: str) -> str:
    if plat != "tpu":
        return plat
    kind = next((d.device_kind for d in jax.devices() if d.platform == "tpu"), "")
    return "tpu_v6e" if "v6" in kind else "tpu_v5e"


def _table_row(plat: str) -> dict:
    return BLOCKS[_table_name(plat)]


def default_blocks(kernel: str, plat: str) -> tuple[int, ...]:
    """The table's block sizes for ``kernel`` ("flash_fwd", "flash_bwd", "ragged",
    "decode")."""
    return _table_row(plat)[kernel]


def flash_blocks(plat: str, head_dim: int, masked: bool) -> tuple[tuple[int, int], ...]:
    """(forward, backward) flash blocks: FLASH_UNMASKED's for a call without a wide mask
    (``masked``: a mask of more than 2 bytes an entry) at a head dim measured there, else
    the table's."""
    measured = FLASH_UNMASKED.get(_table_name(plat), {}).get(head_dim)
    if measured is not None and not masked:
        return measured
    return default_blocks("flash_fwd", plat), default_blocks("flash_bwd", plat)


def fit_block(n: int, want: int, step: int, whole: bool = True) -> int:
    """The largest ``want / 2**i`` (>= ``step``) dividing ``n``; ``n`` itself when none does,
    or at once when ``n <= want`` and ``whole`` (a block spanning the dim is legal for
    Mosaic; Triton wants powers of two, so GPU callers pass ``whole=False``)."""
    if whole and n <= want:
        return n
    b = want
    while b >= step:
        if b <= n and n % b == 0:
            return b
        b //= 2
    return n


def pallas_call(kernel, **kwargs):
    """``pl.pallas_call(kernel, **kwargs)`` whose call traces in JAX's default 32-bit mode
    (Note [Kernels trace in 32-bit mode]). Its 64-bit operands would be narrowed there:
    pass int32 schedules and lengths."""
    call = pl.pallas_call(kernel, **kwargs)

    def run(*args):
        with jax.enable_x64(False):
            return call(*args)

    return run


# Note [Kernel matmul precision]
# A float32 product inside a kernel is contracted at full float32 precision
# (``Precision.HIGHEST``: Mosaic's ``contract_precision<fp32>``; IEEE in Triton), the
# precision of torch's default ``set_float32_matmul_precision("highest")``, which the XLA
# products follow (Note [Matmul precision] in torchjax/ops/matmul.py). Mosaic's default
# for float32 operands is a single bfloat16 pass, about 1e-3 relative error, where CPU
# torch is within 1e-6. Mosaic offers those two only, so the kernels do not follow the
# knob's "high" and "medium": float32 attention and grouped matmuls stay exact, and
# bfloat16/float16 operands (one MXU pass whatever the setting) are the fast path.
# Two consequences seen on the chip (v5e):
# - a half-precision product must never ask for HIGHEST inside a Mosaic kernel: Mosaic
#   refuses ``contract_precision<fp32>`` on bfloat16 operands ("Bad lhs type"), and
#   ``lax.ragged_dot`` is itself a Mosaic kernel on TPU, so aten::_grouped_mm passes it
#   no precision for them (the product is exact in float32 either way);
# - tokamax's TPU attention (splash attention) takes a ``precision`` argument but its
#   kernel's products do not use it: float32 inputs came out 7e-3 from CPU torch. Its
#   wrapper enters ``jax.default_matmul_precision("highest")`` for float32 inputs, in the
#   forward and every backward (``in_32bit_mode``), which its products then follow.
def grid_spec(plat: str, num_scalar_prefetch: int, **kwargs):
    """A grid spec with ``num_scalar_prefetch`` leading operands prefetched into SMEM and
    passed to the index maps (``pltpu.PrefetchScalarGridSpec``; TPU and interpret mode),
    or a plain ``pl.GridSpec`` without."""
    if not num_scalar_prefetch:
        return pl.GridSpec(**kwargs)
    if plat == "gpu":
        raise ValueError("torchjax.pallas: no scalar prefetch on platform 'gpu' (Triton)")
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_scalar_prefetch, **kwargs)


F32 = jnp.float32


def precision_of(a, b):
    """HIGHEST for two float32 operands, else None (Note [Kernel matmul precision]); the
    jnp references use it too: XLA:TPU's default for float32 is also one bfloat16 pass."""
    return lax.Precision.HIGHEST if a.dtype == F32 and b.dtype == F32 else None


def kernel_dot(a, b, dimension_numbers):
    """``lax.dot_general`` accumulating in float32, float32 operands at HIGHEST (Note
    [Kernel matmul precision])."""
    precision = precision_of(a, b)
    return lax.dot_general(a, b, dimension_numbers, precision=precision, preferred_element_type=F32)


def legal_block(plat: str, n: int, block: int, step: int) -> int:
    """``block`` (a caller's block size for a dim of ``n``) as Mosaic accepts it: on TPU
    a block dim must be a multiple of its tile step (8 sublanes, 128 lanes) or the whole
    dim, so a smaller or unaligned block is raised to the smallest multiple of ``step``
    dividing ``n`` (``n`` itself when none does); other platforms take it as it is.
    Blocks change how a kernel walks its arrays, never its values."""
    if plat != "tpu" or block >= n or block % step == 0:
        return min(block, n)
    b = -(-block // step) * step
    while b < n and n % b:
        b += step
    return min(b, n)


def compiler_params(plat: str, semantics: tuple[str, ...] | None = None):
    """Pallas compiler parameters for ``plat``: Triton's on GPU (jax 0.10 lowers a
    ``pallas_call`` without them through Mosaic GPU, which has no ``dot_general`` for these
    kernels' lane-level code); Mosaic's with the grid's ``dimension_semantics`` on TPU
    ("arbitrary" marks a reduction dimension: it must run in order on one core);
    None in interpret mode."""
    if plat == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams()
    if plat == "tpu" and semantics:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=semantics)
    return None


def scratch(plat: str, shape: tuple[int, ...], dtype):
    """A scratch buffer: ``pltpu.VMEM`` on TPU; in interpret mode the backend-neutral
    ``pl.MemorySpace.DEFAULT`` (the interpreter reads only its shape and dtype; Mosaic
    would place it in VMEM too). Triton has none (Note [Kernel platforms])."""
    if plat == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.VMEM(shape, dtype)
    if plat == "interpret":
        return pl.MemorySpace.DEFAULT(shape, dtype)
    raise ValueError(f"torchjax.pallas: no scratch memory on platform {plat!r} (Triton)")


def _tiled_bytes(shape: tuple[int, ...], dtype) -> int:
    itemsize = np.dtype(dtype).itemsize
    dims = (1,) * (2 - len(shape)) + tuple(shape)
    packing = max(1, 4 // itemsize)  # 16-bit values pack two rows per 32-bit sublane
    rows = -(-dims[-2] // (SUBLANE * packing)) * SUBLANE * packing
    lanes = -(-dims[-1] // LANE) * LANE
    return math.prod(dims[:-2]) * rows * lanes * itemsize


def _in_vmem(space) -> bool:
    name = str(getattr(space, "value", space) or "default").lower()
    return not any(s in name for s in ("any", "hbm", "smem", "semaphore", "host"))


def program_memory(fn, *args) -> dict[str, int]:
    """Bytes of fast memory one program of each ``pallas_call`` in ``fn(*args)`` holds, as
    the TPU pipeline lays it out (Note [Kernel platforms]): every blocked input and output
    in VMEM twice (double-buffered; a BlockSpec's own ``pipeline_mode`` buffering when it
    sets one), scratch once, each padded to (sublane, 128) tiles; operands left in HBM or
    SMEM are not counted. Values a kernel computes (a tile's scores) come on top.

    Args:
        fn: a jax function calling Pallas kernels (a ``jax.grad`` of one too).
        args: its arguments, or ``jax.ShapeDtypeStruct`` stand-ins (nothing runs).

    Returns:
        ``{kernel name: bytes}``, the largest per name when a name recurs.
    """
    out: dict[str, int] = {}
    for name, _grid, buffers in pallas_call_buffers(jax.make_jaxpr(fn)(*args)):
        total = 0
        for role, shape, dtype, space, count in buffers:
            if not _in_vmem(space):
                continue
            copies = 1 if role == "scratch" else (count or 2)
            total += copies * _tiled_bytes(shape, dtype)
        out[name] = max(out.get(name, 0), total)
    return out
