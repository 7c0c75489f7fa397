"""Pallas kernels vs the jnp path: flash attention and ragged dot, correctness and time.

Run:  python bench/kernels.py [--quick]

Each row runs one shape three ways, all jitted and warmed up first (compile time shown
apart): the jnp reference (what torchjax runs without the kernel: the SDPA math path, or
``jax.lax.ragged_dot``), the Pallas kernel, and CPU torch (``F.scaled_dot_product_attention``,
or a loop of per-expert ``F.linear``). On CPU the kernel runs in Pallas *interpret mode*,
which is much slower than the jnp path by construction: there the table checks the
harness and the numbers (max |kernel - jnp|), not speed. bench/kernels_gpu.py runs the
same rows compiled on a GPU.
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import fmt_us, header, median_us, ratio  # noqa: E402
from torchjax.pallas import kernels  # noqa: E402

# (batch, q heads, kv heads, seq, head dim, causal)
ATTENTION = [(1, 2, 1, 64, 32, True), (1, 4, 2, 128, 64, False)]
ATTENTION_QUICK = [(1, 2, 1, 32, 16, True)]
# (tokens*top_k rows M, K, N, experts)
RAGGED = [(64, 32, 64, 4), (256, 64, 128, 8)]
RAGGED_QUICK = [(32, 16, 32, 4)]


def _timed(fn, *args, runs):
    f = jax.jit(fn)
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    us = median_us(lambda: jax.block_until_ready(f(*args)), warmup=2, runs=runs)
    return out, us, compile_s


def attention_rows(shapes, runs, interpret=None):
    rng = np.random.default_rng(0)
    rows = []
    for b, hq, hkv, s, d, causal in shapes:
        q = rng.standard_normal((b, hq, s, d), np.float32)
        k = rng.standard_normal((b, hkv, s, d), np.float32)
        v = rng.standard_normal((b, hkv, s, d), np.float32)
        args = [jnp.asarray(x) for x in (q, k, v)]
        ref, ref_us, _ = _timed(
            lambda *a, c=causal: kernels.attention_reference(*a, causal=c), *args, runs=runs
        )
        out, k_us, k_compile = _timed(
            lambda *a, c=causal: kernels.flash_attention(*a, causal=c, interpret=interpret),
            *args,
            runs=runs,
        )
        tensors = [torch.from_numpy(x) for x in (q, k, v)]
        cpu_us = median_us(
            lambda t=tensors, c=causal: F.scaled_dot_product_attention(
                *t, is_causal=c, enable_gqa=True
            ),
            warmup=2,
            runs=runs,
        )
        err = float(jnp.abs(out - ref).max())
        name = f"attention B{b} H{hq}/{hkv} S{s} D{d}{' causal' if causal else ''}"
        rows.append((name, ref_us, k_us, cpu_us, k_compile, err))
    return rows


def ragged_rows(shapes, runs, interpret=None):
    rng = np.random.default_rng(1)
    rows = []
    for m, k, n, g in shapes:
        sizes = np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32)
        lhs = rng.standard_normal((m, k), np.float32)
        rhs = rng.standard_normal((g, k, n), np.float32)
        args = [jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes)]
        ref, ref_us, _ = _timed(kernels.ragged_dot_reference, *args, runs=runs)
        out, k_us, k_compile = _timed(
            lambda *a: kernels.ragged_dot(*a, interpret=interpret), *args, runs=runs
        )
        tl, tr = torch.from_numpy(lhs), torch.from_numpy(rhs)
        bounds = np.concatenate([[0], np.cumsum(sizes)])

        def torch_loop(tl=tl, tr=tr, bounds=bounds, g=g):
            return torch.cat([tl[bounds[e] : bounds[e + 1]] @ tr[e] for e in range(g)])

        cpu_us = median_us(torch_loop, warmup=2, runs=runs)
        err = float(jnp.abs(out - ref).max())
        rows.append((f"ragged_dot M{m} K{k} N{n} G{g}", ref_us, k_us, cpu_us, k_compile, err))
    return rows


def print_table(title, rows, kernel_label):
    print(header(title))
    print(
        f"| case | jnp path | {kernel_label} | kernel/jnp | torch CPU | kernel compile "
        "| max abs err |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ref_us, k_us, cpu_us, k_compile, err in rows:
        print(
            f"| {name} | {fmt_us(ref_us)} | {fmt_us(k_us)} | {ratio(k_us, ref_us)} | "
            f"{fmt_us(cpu_us)} | {k_compile:.1f} s | {err:.1e} |"
        )


def main(argv=None):
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    runs = 5 if quick else 20
    rows = attention_rows(ATTENTION_QUICK if quick else ATTENTION, runs)
    rows += ragged_rows(RAGGED_QUICK if quick else RAGGED, runs)
    mode = "interpret" if jax.default_backend() == "cpu" else "compiled"
    print_table("Pallas kernels vs jnp path", rows, f"Pallas kernel ({mode})")


if __name__ == "__main__":
    main()
