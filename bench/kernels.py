"""Pallas kernels vs the jnp path: flash attention, decode attention and ragged dot,
correctness and time.

Run:  python bench/kernels.py [--quick]

Each row runs one shape three ways, all jitted and warmed up first (compile time shown
apart), forward alone and forward + backward (``fwd+bwd`` rows: the gradient of a
weighted sum, so every backward kernel runs): the jnp reference (what torchjax runs
without the kernel: the SDPA math path, or ``jax.lax.ragged_dot``), the Pallas kernel,
and CPU torch (``F.scaled_dot_product_attention``, or a loop of per-expert matmuls).
On CPU the kernel runs in Pallas *interpret mode*, which is much slower than the jnp
path by construction: there the table checks the harness and the numbers (max |kernel -
jnp|), not speed. bench/kernels_gpu.py runs larger rows compiled on a GPU. Decode rows
(forward only: a decode step) attend ``Sq`` new tokens over a cache of ``S_max``
positions filled to ``fill * S_max`` per batch row; the jnp path is SDPA's math over the
whole cache with a mask (what a static-cache decode step runs without the kernel), the
kernel reads only the filled key blocks (a ``paged`` row: pages of that many positions,
the jnp path gathering them first).
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
# (batch, q heads, kv heads, new tokens Sq, cache S_max, head dim, fill, page size or 0)
DECODE = [
    (2, 4, 2, 1, 1024, 64, 0.5, 0),
    (2, 8, 2, 4, 2048, 64, 0.25, 0),
    (2, 4, 2, 1, 1024, 64, 0.5, 128),
]
DECODE_QUICK = [(1, 4, 2, 1, 512, 32, 0.5, 0)]
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


def _loss_grad(fn, ct, argnums):
    """``fn``'s gradient of ``sum(fn(*a) * ct)``: forward and backward kernels together."""
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct), argnums=argnums)


def _max_err(out, ref) -> float:
    pairs = zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref))
    return max(float(jnp.abs(o.astype(jnp.float32) - r).max()) for o, r in pairs)


def _torch_us(fn, tensors, grad, runs):
    if not grad:
        return median_us(lambda: fn(*tensors), warmup=2, runs=runs)
    leaves = [t.detach().requires_grad_() for t in tensors]

    def step():
        fn(*leaves).sum().backward()

    return median_us(step, warmup=2, runs=runs)


def attention_rows(shapes, runs, interpret=None, grad=False):
    """One row per (B, Hq, Hkv, S, D, causal) shape; ``grad`` times forward + backward."""
    rng = np.random.default_rng(0)
    rows = []
    for b, hq, hkv, s, d, causal in shapes:
        q = rng.standard_normal((b, hq, s, d), np.float32)
        k = rng.standard_normal((b, hkv, s, d), np.float32)
        v = rng.standard_normal((b, hkv, s, d), np.float32)
        args = [jnp.asarray(x) for x in (q, k, v)]

        def ref_fn(*a, c=causal):
            return kernels.attention_reference(*a, causal=c)

        def kernel_fn(*a, c=causal):
            return kernels.flash_attention(*a, causal=c, interpret=interpret)

        if grad:
            ct = jnp.asarray(rng.standard_normal((b, hq, s, d), np.float32))
            ref_fn, kernel_fn = (_loss_grad(f, ct, (0, 1, 2)) for f in (ref_fn, kernel_fn))
        ref, ref_us, _ = _timed(ref_fn, *args, runs=runs)
        out, k_us, k_compile = _timed(kernel_fn, *args, runs=runs)
        tensors = [torch.from_numpy(x) for x in (q, k, v)]

        def sdpa(*t, c=causal):
            return F.scaled_dot_product_attention(*t, is_causal=c, enable_gqa=True)

        # CPU torch materialises the (S, S) scores per head: skipped on long rows.
        cpu_us = _torch_us(sdpa, tensors, grad, runs) if s <= 4096 else "skipped"
        name = f"attention B{b} H{hq}/{hkv} S{s} D{d}{' causal' if causal else ''}"
        name += " fwd+bwd" if grad else ""
        rows.append((name, ref_us, k_us, cpu_us, k_compile, _max_err(out, ref)))
    return rows


def decode_rows(shapes, runs, interpret=None, grad=False):
    """One row per (B, Hq, Hkv, Sq, S_max, D, fill, page) shape (forward only)."""
    rng = np.random.default_rng(2)
    rows = []
    for b, hq, hkv, sq, s, d, fill, page in shapes:
        q = rng.standard_normal((b, hq, sq, d), np.float32)
        k = rng.standard_normal((b, hkv, s, d), np.float32)
        v = rng.standard_normal((b, hkv, s, d), np.float32)
        lengths = np.full((b,), max(sq, int(fill * s)), np.int32)
        if page:
            # the cache's pages shuffled in one pool, the table saying where each went
            per_seq = s // page
            table = rng.permutation(b * per_seq).reshape(b, per_seq).astype(np.int32)

            def to_pages(x, table=table, per_seq=per_seq, page=page):
                x = x.reshape(b, hkv, per_seq, page, d).transpose(0, 2, 1, 3, 4)
                pool = np.empty((b * per_seq, hkv, page, d), np.float32)
                pool[table.reshape(-1)] = x.reshape(-1, hkv, page, d)
                return pool

            args = [jnp.asarray(x) for x in (q, to_pages(k), to_pages(v), table, lengths)]
            ref_fn = kernels.paged_decode_attention_reference

            def kernel_fn(*a):
                return kernels.paged_decode_attention(*a, interpret=interpret)
        else:
            args = [jnp.asarray(x) for x in (q, k, v, lengths)]
            ref_fn = kernels.decode_attention_reference

            def kernel_fn(*a):
                return kernels.decode_attention(*a, interpret=interpret)

        ref, ref_us, _ = _timed(ref_fn, *args, runs=runs)
        out, k_us, k_compile = _timed(kernel_fn, *args, runs=runs)
        cols = np.arange(s)[None, None, None, :]
        limit = lengths[:, None, None, None] - sq + 1 + np.arange(sq)[None, None, :, None]
        tensors = [torch.from_numpy(x) for x in (q, k, v, cols < limit)]

        def sdpa(tq, tk, tv, mask):
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

        # CPU torch expands GQA and scores the whole cache: skipped on large rows.
        cpu_us = _torch_us(sdpa, tensors, False, runs) if b * hq * s <= 2**20 else "skipped"
        name = f"decode B{b} H{hq}/{hkv} Sq{sq} S_max{s} D{d} filled {fill:.0%}"
        name += f" paged {page}" if page else ""
        rows.append((name, ref_us, k_us, cpu_us, k_compile, _max_err(out, ref)))
    return rows


def ragged_rows(shapes, runs, interpret=None, grad=False):
    """One row per (M, K, N, G) shape; ``grad`` times forward + backward."""
    rng = np.random.default_rng(1)
    rows = []
    for m, k, n, g in shapes:
        sizes = np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32)
        lhs = rng.standard_normal((m, k), np.float32)
        rhs = rng.standard_normal((g, k, n), np.float32)
        group_sizes = jnp.asarray(sizes)
        args = [jnp.asarray(lhs), jnp.asarray(rhs)]

        def ref_fn(a, w):
            return kernels.ragged_dot_reference(a, w, group_sizes)

        def kernel_fn(a, w):
            return kernels.ragged_dot(a, w, group_sizes, interpret=interpret)

        if grad:
            ct = jnp.asarray(rng.standard_normal((m, n), np.float32))
            ref_fn, kernel_fn = (_loss_grad(f, ct, (0, 1)) for f in (ref_fn, kernel_fn))
        ref, ref_us, _ = _timed(ref_fn, *args, runs=runs)
        out, k_us, k_compile = _timed(kernel_fn, *args, runs=runs)
        bounds = np.concatenate([[0], np.cumsum(sizes)])

        def torch_loop(tl, tr, bounds=bounds, g=g):
            return torch.cat([tl[bounds[e] : bounds[e + 1]] @ tr[e] for e in range(g)])

        cpu_us = _torch_us(torch_loop, [torch.from_numpy(lhs), torch.from_numpy(rhs)], grad, runs)
        name = f"ragged_dot M{m} K{k} N{n} G{g}" + (" fwd+bwd" if grad else "")
        rows.append((name, ref_us, k_us, cpu_us, k_compile, _max_err(out, ref)))
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
    rows = []
    for grad in (False, True):
        rows += attention_rows(ATTENTION_QUICK if quick else ATTENTION, runs, grad=grad)
        rows += ragged_rows(RAGGED_QUICK if quick else RAGGED, runs, grad=grad)
    rows += decode_rows(DECODE_QUICK if quick else DECODE, runs)
    mode = "interpret" if jax.default_backend() == "cpu" else "compiled"
    print_table("Pallas kernels vs jnp path", rows, f"Pallas kernel ({mode})")


if __name__ == "__main__":
    main()
