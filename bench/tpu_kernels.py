"""The kernel sections of bench/tpu.py: torchjax's Pallas kernels on the chip against
jax's own TPU kernels, XLA and the roofline, in bfloat16.

``attention`` (causal, forward and forward + backward; the backward is the gradient of
the output's sum, so every backward kernel runs), per shape (B, Hq/Hkv, S, D):

- ``torchjax``: ``torchjax.pallas.flash_attention`` (the kernel alone);
- ``sdpa``: ``F.scaled_dot_product_attention`` on tpu tensors under ``torchjax.jit``,
  what a model calls (the kernel behind torch's op); ``sdpa_math``: the same with the
  kernel switched off (``use_flash_attention(False)``), the math fallback;
- ``jax_flash``: jax's Pallas TPU flash attention at the better of 512 and 1024 blocks
  (grouped heads by repeating k and v: it has no GQA); ``splash``: jax's splash
  attention (MQA kernel per key/value head) at the better of 512 and 1024 blocks;
- ``xla``: ``jax.nn.dot_product_attention`` (XLA's attention);
- ``flop_limit``: the causal half of the score and value products at 197 TFLOP/s.

A padded row: causal plus key padding (rows of 100%, 75%, 50%, 25% valid keys), the
(B, 1, S, S) bool mask a transformers model passes, against jax's flash with segment ids
(which reads no mask) and XLA with the mask.

``kernels``: the decode kernel (one new token per row over 8K and 32K caches filled to a
tenth and to half) against the masked XLA step and the HBM limit (the filled cache read
once at 819 GB/s); the ragged dot (a Qwen3-30B-A3B-like MoE layer: d 2048, 128 experts,
top 8, expert width 768, 2048 tokens; a Mixtral-like one: d 4096, 8 experts, top 2,
width 14336, 4096 tokens; both projections of each) forward and forward + backward
against ``jax.lax.ragged_dot`` and tokamax's TPU kernel (its default configuration).

Every time is the median of 10 jitted calls after a first call (its compile time kept
apart). ``best_other_ms`` is the fastest of the other implementations; ``vs_best`` is
that over torchjax's time (above 1: torchjax is faster).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOPS_PER_S = 197e12
HBM_BYTES_PER_S = 819e9
ATTENTION = [(4, 32, 8, 2048, 64), (4, 16, 16, 2048, 128), (1, 16, 2, 8192, 128)]
ATTENTION_SMALL = [(1, 4, 2, 256, 64)]
PADDED = (4, 16, 2048, 128)
PADDED_SMALL = (2, 2, 256, 64)
JAX_BLOCKS = (512, 1024)
# (batch, q heads, kv heads, cache length, head dim)
DECODE = [(8, 32, 8, 8192, 128), (8, 32, 8, 32768, 128)]
DECODE_SMALL = [(2, 4, 2, 1024, 64)]
# (name, rows M = tokens * top_k, K, N, experts)
RAGGED = [
    ("qwen3-30b-a3b gate_up", 16384, 2048, 1536, 128),
    ("qwen3-30b-a3b down", 16384, 768, 2048, 128),
    ("mixtral gate_up", 8192, 4096, 28672, 8),
    ("mixtral down", 8192, 14336, 4096, 8),
]
RAGGED_SMALL = [("small", 512, 256, 256, 8)]


def timed(fn, *args, runs=10):
    """(median ms of the jitted ``fn``, compile-and-first-call s, its first output)."""
    import time

    f = jax.jit(fn)
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e3, 3), round(first, 1), out


def _ms(fn, *args, runs=10):
    """(median ms of the jitted ``fn``, compile-and-first-call s), or an error text."""
    try:
        ms, first, _ = timed(fn, *args, runs=runs)
        return ms, first
    except Exception as e:  # noqa: BLE001 - a failed variant is reported, the rest run
        return f"{type(e).__name__}: {str(e)[:300]}", None


def grad_of_sum(fn, argnums):
    """The gradients of ``fn``'s output summed in float32."""
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums)


def _best(row: dict, names) -> None:
    """Add ``best_other_ms`` (the fastest of ``names``) and torchjax's ``vs_best``."""
    times = {n: row[n] for n in names if isinstance(row.get(n), float)}
    if times and isinstance(row.get("torchjax"), float):
        name = min(times, key=times.get)
        row["best_other"] = f"{name} {times[name]}"
        row["vs_best"] = round(times[name] / row["torchjax"], 3)


def _arr(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)


def _torch_sdpa(flash: bool, grad: bool):
    """SDPA through torch on tpu tensors under ``torchjax.jit``, as a jax function."""
    import torch
    import torch.nn.functional as F

    import torchjax
    from torchjax.pallas import use_flash_attention

    def f(q, k, v, mask=None):
        causal = mask is None
        with use_flash_attention(flash):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
        if not grad:
            return out
        return torch.autograd.grad(out.float().sum(), (q, k, v))

    step = torchjax.jit(f)

    def run(*arrays):
        tensors = [torchjax.interop.from_jax(a) for a in arrays]
        for t in tensors[:3]:
            t.requires_grad_(grad)
        out = step(*tensors)
        return jax.tree_util.tree_map(torchjax.interop.to_jax, out)

    return run


def _torch_ms(run, *args, runs=10):
    import time

    try:
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        first = time.perf_counter() - t0
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(run(*args))
            times.append(time.perf_counter() - t0)
        return round(float(np.median(times)) * 1e3, 3), round(first, 1)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}", None


def _jax_flash(b, hq, hkv, s, d, grad, segments=None):
    from jax.experimental.pallas.ops.tpu import flash_attention as jf

    group = hq // hkv
    out = {}
    for blk in JAX_BLOCKS:
        blk = min(blk, s)
        sizes = jf.BlockSizes(
            block_q=blk, block_k_major=blk, block_k=blk, block_b=1, block_q_major_dkv=blk,
            block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk, block_k_major_dq=blk,
            block_k_dq=blk, block_q_dq=blk,
        )  # fmt: skip

        def fn(q, k, v, sizes=sizes):
            k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
            seg = None if segments is None else jf.SegmentIds(segments, segments)
            return jf.flash_attention(
                q, k, v, segment_ids=seg, causal=True, sm_scale=d**-0.5, block_sizes=sizes
            )

        out[blk] = grad_of_sum(fn, (0, 1, 2)) if grad else fn
    return out


def _splash(b, hq, hkv, s, d, grad):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    group = hq // hkv
    out = {}
    for blk in JAX_BLOCKS:
        blk = min(blk, s)
        mask = sa.MultiHeadMask([sa.CausalMask((s, s))] * group)
        sizes = sa.BlockSizes(
            block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
            block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk,
        )  # fmt: skip
        kernel = sa.make_splash_mqa_single_device(mask=mask, block_sizes=sizes)

        def fn(q, k, v, kernel=kernel):
            qg = (q * d**-0.5).reshape(b, hkv, group, s, d)
            return jax.vmap(jax.vmap(kernel))(qg, k, v).reshape(b, hq, s, d)

        out[blk] = grad_of_sum(fn, (0, 1, 2)) if grad else fn
    return out


def _xla(mask=None):
    def fn(q, k, v):
        t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        causal = mask is None
        return t(jax.nn.dot_product_attention(t(q), t(k), t(v), mask=mask, is_causal=causal))

    return fn


def _fastest(fns: dict, *args) -> tuple:
    """The fastest of ``fns`` (block -> function): (ms, block), or the last error."""
    best, err = None, None
    for blk, fn in fns.items():
        ms, _ = _ms(fn, *args)
        if isinstance(ms, float):
            best = min(best or (ms, blk), (ms, blk))
        else:
            err = ms
    return best if best else (err, None)


def attention(ctx) -> dict:
    from torchjax.pallas import kernels as tk

    on_tpu = jax.default_backend() == "tpu"
    rng = np.random.default_rng(0)
    out = {}
    for b, hq, hkv, s, d in ATTENTION_SMALL if ctx.small else ATTENTION:
        q, k, v = _arr(rng, b, hq, s, d), _arr(rng, b, hkv, s, d), _arr(rng, b, hkv, s, d)
        for grad in (False, True):
            row = {"flop_limit": round(4 * b * hq * s * s * d / 2 * (3.5 if grad else 1)
                                       / FLOPS_PER_S * 1e3, 3)}  # fmt: skip

            def ours(q, k, v):
                return tk.flash_attention(q, k, v, causal=True)

            row["torchjax"], row["torchjax_compile_s"] = _ms(
                grad_of_sum(ours, (0, 1, 2)) if grad else ours, q, k, v
            )
            row["sdpa"], _ = _torch_ms(_torch_sdpa(True, grad), q, k, v)
            row["sdpa_math"], _ = _torch_ms(_torch_sdpa(False, grad), q, k, v)
            xla = _xla()
            row["xla"], _ = _ms(grad_of_sum(xla, (0, 1, 2)) if grad else xla, q, k, v)
            if on_tpu:
                ms, blk = _fastest(_jax_flash(b, hq, hkv, s, d, grad), q, k, v)
                row["jax_flash"], row["jax_flash_block"] = ms, blk
                ms, blk = _fastest(_splash(b, hq, hkv, s, d, grad), q, k, v)
                row["splash"], row["splash_block"] = ms, blk
            _best(row, ("jax_flash", "splash", "xla"))
            if isinstance(row["sdpa_math"], float) and isinstance(row["xla"], float):
                row["sdpa_math_vs_xla"] = round(row["sdpa_math"] / row["xla"], 2)
            kind = "fwd+bwd" if grad else "fwd"
            out[f"{kind} ({b},{hq}/{hkv},{s},{d})"] = row
    out.update(_padded(ctx, rng, on_tpu))
    return out


def _padded(ctx, rng, on_tpu) -> dict:
    from torchjax.pallas import kernels as tk

    b, h, s, d = PADDED_SMALL if ctx.small else PADDED
    q, k, v = (_arr(rng, b, h, s, d) for _ in range(3))
    lengths = np.array([s, 3 * s // 4, s // 2, s // 4][:b])
    valid = np.arange(s)[None, :] < lengths[:, None]
    mask = jnp.asarray(np.tril(np.ones((s, s), bool))[None, None] & valid[:, None, None, :])
    segments = jnp.asarray(np.where(valid, 1, 2), jnp.int32)  # padding: its own segment
    out = {}
    for grad in (False, True):
        row = {}

        def ours(q, k, v, m):
            return tk.flash_attention(q, k, v, m)

        row["torchjax"], _ = _ms(grad_of_sum(ours, (0, 1, 2)) if grad else ours, q, k, v, mask)
        row["sdpa"], _ = _torch_ms(_torch_sdpa(True, grad), q, k, v, mask)
        row["sdpa_math"], _ = _torch_ms(_torch_sdpa(False, grad), q, k, v, mask)
        xla = _xla(mask)
        row["xla"], _ = _ms(grad_of_sum(xla, (0, 1, 2)) if grad else xla, q, k, v)
        if on_tpu:
            ms, blk = _fastest(_jax_flash(b, h, h, s, d, grad, segments), q, k, v)
            row["jax_flash_segment_ids"], row["jax_flash_block"] = ms, blk
        _best(row, ("jax_flash_segment_ids", "xla"))
        out[f"{'fwd+bwd' if grad else 'fwd'} padded ({b},{h},{s},{d}) (B,1,S,S) mask"] = row
    return out


def kernels(ctx) -> dict:
    from torchjax.pallas import kernels as tk

    rng = np.random.default_rng(1)
    out = {}
    for b, hq, hkv, s, d in DECODE_SMALL if ctx.small else DECODE:
        q, k, v = _arr(rng, b, hq, 1, d), _arr(rng, b, hkv, s, d), _arr(rng, b, hkv, s, d)
        for fill in (0.1, 0.5):
            n = jnp.full((b,), int(s * fill), jnp.int32)
            row = {"hbm_limit": round(2 * b * hkv * s * fill * d * 2 / HBM_BYTES_PER_S * 1e3, 4)}
            row["torchjax"], _ = _ms(lambda q, k, v, n: tk.decode_attention(q, k, v, n), q, k, v, n)
            row["xla_masked"], _ = _ms(tk.decode_attention_reference, q, k, v, n)
            _best(row, ("xla_masked",))
            out[f"decode ({b},{hq}/{hkv}) cache {s} filled {fill:.0%}"] = row
    out.update(_ragged(ctx, rng))
    return out


def _tokamax_ragged():
    from torchjax.pallas._jax_mode import in_32bit_mode
    from torchjax.pallas._tokamax import _tokamax

    return in_32bit_mode(_tokamax().ragged_dot)


def _ragged(ctx, rng) -> dict:
    from torchjax.pallas import kernels as tk

    impls = {"torchjax": tk.ragged_dot, "lax": jax.lax.ragged_dot}
    if jax.default_backend() == "tpu":
        impls["tokamax"] = _tokamax_ragged()
    out = {}
    for name, m, kk, n, g in RAGGED_SMALL if ctx.small else RAGGED:
        lhs, rhs = _arr(rng, m, kk), _arr(rng, g, kk, n)
        sizes = jnp.asarray(np.bincount(rng.integers(0, g, m), minlength=g), jnp.int32)
        for grad in (False, True):
            row = {"flop_limit": round(2 * m * kk * n * (3 if grad else 1) / FLOPS_PER_S * 1e3, 3)}
            for label, fn in impls.items():
                row[label], _ = _ms(grad_of_sum(fn, (0, 1)) if grad else fn, lhs, rhs, sizes)
            _best(row, ("lax", "tokamax"))
            kind = "fwd+bwd" if grad else "fwd"
            out[f"ragged dot {kind} {name} ({m},{kk},{n}) {g} groups"] = row
    return out
