"""The ``compiles`` section of bench/tpu.py: where XLA compile time goes, by layer count.

A first ``generate`` on the chip spends most of its time in XLA compiles (the 1.1B
Llama's prefill program 18 s cold, more than the pure-JAX model's whole program), and a
MoE model's prefill took 60 s. Three questions, each answered by compile seconds from
jax.monitoring's ``backend_compile_duration`` events, with the persistent compilation
cache off for the section:

- ``forward``: the prefill forward (batch 1, 128 tokens, bfloat16, ``torchjax.jit``,
  ``torch.no_grad``) of the Llama of bench/tpu.py and the Qwen3-MoE of bench/tpu_moe.py
  at 1, 2 and 4 layers: the compile seconds per layer (the slope) and outside the layers
  (the intercept), for the Llama with the Pallas kernels on and off and for the MoE with
  transformers' ``grouped_mm`` experts and with ``torchjax_ragged_dot``. A slope far
  above another's names the part that compiles slowly;
- ``flash_sites``: one jitted function calling the flash kernel once, and 16 times on the
  same shapes (each call's output feeding the next): whether each call site of a Pallas
  kernel is compiled on its own;
- ``cumsum``: an int64 and an int32 ``cumsum`` of (1, 128) and (1, 2048) (position ids:
  the int64 one took 2.9 s cold on the chip);
- ``cache_writes``: the KV-cache writes of one forward of the Llama (2 per layer, 32;
  caches of 256 positions), of one position (a decode step) and of 128 (the prefill), at
  a traced position, compiled as a scatter and as a dynamic-update-slice in jax, and as
  torchjax lowers ``index_copy_`` under ``torchjax.jit`` (Note [Index writes at a run of
  positions]: one position is a slice write, 128 traced ones stay a scatter);
- ``moe_parts``: each part of the MoE layer jitted alone on its shapes in the prefill
  (128 tokens x top 8 = 1024 token-expert pairs) and in decoding (8 pairs): router,
  sort, gather, group sizes, each expert product (``lax.ragged_dot``, the few-rows
  gathered form of Note [Grouped products of few rows], torchjax's Pallas kernel), the
  combine. On CPU no part compiles slowly and the MoE layer compiles about as fast as a
  dense one: the chip says which part takes its 5 s per layer.

``forward`` also times the MoE decode step (one token, ``seq`` 1) by layer count: its
expert products take the gathered form there.

``TORCHJAX_BENCH_ROWS`` (comma-separated part names: ``cumsum``, ``cache_writes``, ``moe_parts``,
``flash_sites``, ``forward``) runs only those parts; ``TORCHJAX_BENCH_VARIANTS``
(comma-separated prefixes of ``forward``'s variant names, e.g. ``moe``) only those
variants.

Run:  python -m bench.tpu --sections compiles   (``--small``: small models, off the chip)
"""

from __future__ import annotations

import collections
import os
import sys
import time
from contextlib import nullcontext

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_seconds = collections.Counter()


def _on(event, duration, **kw):
    if event == _COMPILE_EVENT:
        _seconds["s"] += duration
        _seconds["n"] += 1


def _progress(what: str) -> None:
    print(f"compiles: {what} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)


def _compiled(call) -> dict:
    """XLA compile seconds and count of ``call()``'s first run, and its wall time."""
    before = dict(_seconds)
    t0 = time.perf_counter()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported, the rest runs
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    wall = time.perf_counter() - t0
    return {
        "compile_s": round(_seconds["s"] - before.get("s", 0.0), 2),
        "compiles": _seconds["n"] - before.get("n", 0),
        "wall_s": round(wall, 2),
    }


def _slope(rows: dict, layers: tuple) -> dict:
    """Least-squares compile seconds per layer and outside them, over ``layers``."""
    pts = [(n, rows[n]["compile_s"]) for n in layers if "compile_s" in rows.get(n, {})]
    if len(pts) < 2:
        return {}
    mx = sum(n for n, _ in pts) / len(pts)
    my = sum(s for _, s in pts) / len(pts)
    slope = sum((n - mx) * (s - my) for n, s in pts) / sum((n - mx) ** 2 for n, _ in pts)
    return {"per_layer_s": round(slope, 2), "outside_s": round(my - slope * mx, 2)}


def _forward_rows(make, variants: dict, layers: tuple, seq: int) -> dict:
    """{variant: compile rows by layer count}; a variant is (setup(model), the context its
    calls run in)."""
    import torch

    import torchjax

    out = {}
    only = os.environ.get("TORCHJAX_BENCH_VARIANTS")
    for name, (setup, context) in variants.items():
        if only and not any(name.startswith(p) for p in only.split(",")):
            continue
        rows = {}
        for n in layers:
            _progress(f"{name}, {n} layers")
            torch.manual_seed(0)
            with torch.device("tpu"):
                model = make(n).to(torch.bfloat16).eval()
            setup(model)
            ids = torch.randint(3, model.config.vocab_size, (1, seq)).to("tpu")
            step = torchjax.jit(lambda ids, model=model: model(ids).logits[:, -1])

            def call(step=step, ids=ids, context=context):
                with torch.no_grad(), context():
                    torchjax.interop.to_jax(step(ids)).block_until_ready()

            rows[n] = _compiled(call)
            del model, step
        out[name] = {"by_layers": rows, **_slope(rows, layers)}
    return out


def forward(small: bool) -> dict:
    import transformers as tf

    from bench import tpu, tpu_moe
    from torchjax.integrations.transformers._moe import NAME, register_experts
    from torchjax.pallas import use_flash_attention

    register_experts()
    layers = (1, 2) if small else (1, 2, 4)
    seq = 32 if small else 128

    def llama(n):
        cfg = tpu.llama_config(small)
        cfg.num_hidden_layers = n
        return tf.LlamaForCausalLM(cfg)

    def moe(n):
        cfg = tpu_moe._config(small)
        cfg.num_hidden_layers = n
        return tf.Qwen3MoeForCausalLM(cfg)

    kernels = {
        f"llama, kernels {'on' if on else 'off'}": (
            lambda model: None,
            lambda on=on: use_flash_attention(on),
        )
        for on in (True, False)
    }
    out = _forward_rows(llama, kernels, layers, seq)
    experts = {
        f"moe, {impl}": (lambda m, impl=impl: m.set_experts_implementation(impl), nullcontext)
        for impl in ("grouped_mm", NAME)
    }
    out.update(_forward_rows(moe, experts, layers, seq))
    decode = {f"{name}, decode step": v for name, v in experts.items()}
    out.update(_forward_rows(moe, decode, layers, 1))
    return out


def moe_parts(small: bool) -> dict:
    import jax.numpy as jnp
    from jax import lax

    from bench import tpu_moe
    from torchjax.ops import matmul
    from torchjax.pallas._ragged import ragged_dot

    cfg = tpu_moe._config(small)
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    inter, bf = cfg.moe_intermediate_size, jnp.bfloat16
    key = jax.random.PRNGKey(0)
    w_gu = jax.random.normal(key, (e, 2 * inter, h), bf)  # transformers' (E, out, in)
    w_d = jax.random.normal(key, (e, h, inter), bf)
    w_r = jax.random.normal(key, (e, h), bf)

    def router(x, w_r):
        p = jax.nn.softmax((x @ w_r.T).astype(jnp.float32), axis=-1)
        v, i = lax.top_k(p, k)
        return (v / v.sum(-1, keepdims=True)).astype(bf), i

    def gu_rows(r, w, sizes):  # weights in (E, in, out), as lax.ragged_dot takes them
        return lax.ragged_dot(r, jnp.swapaxes(w, 1, 2), sizes)

    def combine(o, p):
        return o[jnp.argsort(p)].reshape(-1, k, h).astype(jnp.float32).sum(1)

    # Weights are arguments, as in a torchjax.jit program (closed over, they would be
    # constants, and XLA folds their transposes at compile time).
    out = {}
    for phase, tokens in (("prefill", 128), ("decode", 1)):
        m = tokens * k
        x = jax.random.normal(key, (tokens, h), bf)
        ids = jax.random.randint(key, (tokens, k), 0, e)
        rows = jax.random.normal(key, (m, h), bf)
        mid = jax.random.normal(key, (m, inter), bf)
        sizes = jnp.zeros((e,), jnp.int32).at[: min(m, e)].set(max(m // e, 1))
        offs = jnp.cumsum(sizes)
        pairs, order = ids.reshape(-1), jnp.arange(m)
        parts = {
            "router (linear, softmax, top_k)": (router, x, w_r),
            "sort of the pairs by expert": (lambda i, o: lax.sort_key_val(i, o), pairs, order),
            "gather of the pairs' rows": (lambda x, p: x[p // k], x, order),
            "group sizes (one-hot sum)": (lambda i: (i[:, None] == jnp.arange(e)).sum(0), pairs),
            "ragged_dot gate_up": (gu_rows, rows, w_gu, sizes),
            "ragged_dot down": (gu_rows, mid, w_d, sizes),
            "torchjax _grouped_mm gate_up": (
                lambda r, w, o: matmul._grouped_mm(r, jnp.swapaxes(w, 1, 2), o), rows, w_gu, offs,
            ),
            "Pallas ragged_dot gate_up": (
                lambda r, w, s: ragged_dot(r, w, s, transpose_rhs=True), rows, w_gu, sizes,
            ),
            "combine (argsort, gather, sum)": (combine, rows, order),
        }  # fmt: skip
        for name, (fn, *args) in parts.items():
            _progress(f"moe part, {phase}: {name}")
            out[f"{phase} (M={m}): {name}"] = _compiled(
                lambda fn=fn, args=args: jax.block_until_ready(jax.jit(fn)(*args))
            )
    return out


def flash_sites(small: bool) -> dict:
    import jax.numpy as jnp

    from torchjax.pallas import kernels as tk

    b, h, s, d = (1, 4, 128, 64) if small else (1, 32, 128, 64)
    q = jnp.ones((b, h, s, d), jnp.bfloat16)
    out = {}
    for sites in (1, 16):

        def chain(q, sites=sites):
            for _ in range(sites):
                q = tk.flash_attention(q, q, q, causal=True)
            return q

        _progress(f"flash, {sites} call sites")
        out[f"{sites} call sites"] = _compiled(lambda c=chain: jax.jit(c)(q).block_until_ready())
    return out


def cumsum(small: bool) -> dict:
    import jax.numpy as jnp

    out = {}
    for n in (128, 2048):
        for dtype in (jnp.int64, jnp.int32):
            x = jnp.ones((1, n), dtype)
            name = f"cumsum (1,{n}) {jnp.dtype(dtype).name}"
            out[name] = _compiled(
                lambda x=x: jax.jit(lambda a: jnp.cumsum(a, axis=-1))(x).block_until_ready()
            )
    return out


def cache_writes(small: bool) -> dict:
    import jax.numpy as jnp
    import torch
    from jax import lax

    import torchjax
    from bench import tpu

    cfg = tpu.llama_config(small)
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    shape = (1, heads, 256, cfg.hidden_size // cfg.num_attention_heads)
    bf = jnp.bfloat16

    def scatter(c, start, v):
        idx = start + jnp.arange(v.shape[2])
        return c.at[:, :, idx].set(v)

    def slice_write(c, start, v):
        return lax.dynamic_update_slice_in_dim(c, v, start, axis=2)

    def in_jax(write, n):
        caches = [jnp.zeros(shape, bf) for _ in range(2 * layers)]
        v = jnp.ones((*shape[:2], n, shape[3]), bf)
        fn = jax.jit(lambda cs, s, v: [write(c, s, v) for c in cs], donate_argnums=0)
        return lambda: jax.block_until_ready(fn(caches, jnp.int64(3), v))

    def in_torchjax(n):
        with torch.device("tpu"):
            caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * layers)]
            pos = torch.arange(3, 3 + n)
            v = torch.ones((*shape[:2], n, shape[3]), dtype=torch.bfloat16)

        @torchjax.jit
        def step(caches, pos, v):
            for c in caches:
                c.index_copy_(2, pos, v)

        def call():
            step(caches, pos, v)
            torch.tpu.synchronize()

        return call

    out = {}
    _compiled(in_jax(slice_write, 2))  # the first compile of the section pays for setup
    for n in (1, 128):
        for name, call in (
            ("jax scatter", in_jax(scatter, n)),
            ("jax dynamic_update_slice", in_jax(slice_write, n)),
            ("torchjax index_copy_", in_torchjax(n)),
        ):
            _progress(f"cache writes, {n} positions: {name}")
            out[f"{2 * layers} writes of {n} positions: {name}"] = _compiled(call)
    return out


def compiles(ctx) -> dict:
    jax.monitoring.register_event_duration_secs_listener(_on)
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        parts = {"cumsum": cumsum, "cache_writes": cache_writes, "moe_parts": moe_parts}
        parts["flash_sites"] = flash_sites
        parts["forward"] = forward
        only = os.environ.get("TORCHJAX_BENCH_ROWS")
        return {
            name: part(ctx.small)
            for name, part in parts.items()
            if not only or name in only.split(",")
        }
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
