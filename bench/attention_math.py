"""Where the time of SDPA's math fallback goes on the chip, by formulation.

With the flash kernel off (or a call it does not take), ``F.scaled_dot_product_attention``
on tpu tensors runs torch's math decomposition; on a v5e chip it took 464 ms at
(1, 16/2, 8192, 128) causal GQA bf16 where ``jax.nn.dot_product_attention`` took 19 ms.
Each row times one formulation of the same attention (bf16 q, k, v; causal; forward),
so the difference between two rows is the cost of what they differ in:

- ``torch_math``: the op under ``torchjax.jit`` with the kernel off and torch's
  decomposition forced (what a model ran before Note [SDPA math by platform]);
- ``torch_math_tpu``: the same call with the table's TPU entry forced, i.e. what a model
  runs on the chip now: ``torch.ops.torchjax.exact_attention``
  (torchjax/pallas/_sdpa_math.py), ``exact_qk`` generalised;
- ``f32_highest``: torchjax's fused lowering ``sdpa_math`` on float32 copies (the math
  path's numbers: q and k scaled by sqrt(scale), float32 products at HIGHEST);
- ``f32_default``: the same at DEFAULT precision (one bf16 pass per product);
- ``exact_qk``: the score product on the bf16 inputs with float32 accumulation (bf16
  products are exact in float32), scaled afterwards; the mask from iota; the value
  product in float32 at HIGHEST (``exact_qk_high``: at HIGH, three bf16 passes);
- ``bf16_probs``: as ``exact_qk`` but the probabilities rounded to bf16 for the value
  product at DEFAULT (what XLA's attention computes); why the op keeps the value product
  in float32 at HIGHEST: Note [The value product stays float32];
- ``xla``: ``jax.nn.dot_product_attention``;
- ``*_fwd_bwd``: forward and backward, ``jax.grad`` of the output's float32 sum with
  respect to q, k and v, for ``exact_qk``, ``torch_math`` and ``torch_math_tpu``.

Each row: median ms of 10 calls after the first (3 for the rows of about half a second a
call at 8192, ``_SLOW``), and the largest difference from the
``f32_highest`` output in units of bf16's epsilon (``*_fwd_bwd`` rows: the largest
difference of the three gradients from ``exact_qk_fwd_bwd``'s, as a share of each
gradient's largest magnitude, in bf16 epsilons). With ``--hlo DIR`` the optimized HLO
of ``torch_math`` at each shape is written there, with XLA's memory analysis.

Run:  python bench/attention_math.py [--small] [--hlo DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.tpu_kernels import grad_of_sum, timed  # noqa: E402

SHAPES = [(1, 16, 2, 8192, 128), (4, 16, 16, 2048, 128)]
SMALL = [(1, 4, 2, 512, 64)]
#: Rows that took about 0.46 s a call at sequence 8192 (their backward more): 3 calls
#: there keep the run short.
_SLOW = ("torch_math", "f32_highest", "f32_default", "bf16_probs", "torch_math_fwd_bwd")
_HI = jax.lax.Precision.HIGHEST


def _causal(length, source):
    rows = jax.lax.broadcasted_iota(jnp.int32, (length, source), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (length, source), 1)
    return cols <= rows


def _group(q, k):
    """q (B, Hq, L, E) as (B, Hkv, Hq // Hkv, L, E): grouped heads without repeating k, v."""
    b, hq, length, e = q.shape
    return q.reshape(b, k.shape[1], hq // k.shape[1], length, e)


def _formulation(qk_dtype, pv: str, qk_precision=None):
    def fn(q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = _group(q, k).astype(qk_dtype)
        s = jnp.einsum(
            "bhrle,bhse->bhrls", qg, k.astype(qk_dtype),
            precision=qk_precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        s = jnp.where(_causal(q.shape[2], k.shape[2]), s * scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        if pv == "bf16":
            o = jnp.einsum("bhrls,bhse->bhrle", p.astype(v.dtype), v,
                           preferred_element_type=jnp.float32)  # fmt: skip
        else:
            prec = _HI if pv == "highest" else jax.lax.Precision.HIGH
            o = jnp.einsum("bhrls,bhse->bhrle", p, v.astype(jnp.float32), precision=prec)
        return o.reshape(q.shape).astype(q.dtype)

    return fn


def _f32(precision):
    from torchjax.ops.attention import sdpa_math

    def fn(q, k, v):
        f = lambda x: x.astype(jnp.float32)  # noqa: E731
        out = sdpa_math(f(q), f(k), f(v), is_causal=True, enable_gqa=True)
        return out.astype(q.dtype)

    if precision is None:
        return fn

    def default(q, k, v):
        with jax.default_matmul_precision("default"):
            # sdpa_math names HIGHEST on its products; swap it for this row.
            import torchjax.ops.attention as a

            old, a._HIGHEST = a._HIGHEST, None
            try:
                return fn(q, k, v)
            finally:
                a._HIGHEST = old

    return default


def _xla(q, k, v):
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True))


def _torch_math(choice="decompose"):
    import torch.nn.functional as F

    import torchjax
    from torchjax.pallas import use_flash_attention, use_math_attention

    def f(q, k, v):
        with use_flash_attention(False), use_math_attention(choice):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fn(q, k, v):
        args = [torchjax.interop.from_jax(a) for a in (q, k, v)]
        return torchjax.interop.to_jax(f(*args))

    return fn


def _fwd_bwd(fn):
    """Forward and backward: the gradients of the output's float32 sum."""
    return grad_of_sum(fn, (0, 1, 2))


def run(shapes, hlo_dir=None) -> dict:
    rows = {
        "torch_math": _torch_math(),
        "torch_math_tpu": _torch_math("exact"),
        "f32_highest": _f32(None),
        "f32_default": _f32("default"),
        "exact_qk": _formulation(jnp.bfloat16, "highest"),
        "exact_qk_high": _formulation(jnp.bfloat16, "high"),
        "bf16_probs": _formulation(jnp.bfloat16, "bf16"),
        "xla": _xla,
        "exact_qk_fwd_bwd": _fwd_bwd(_formulation(jnp.bfloat16, "highest")),
        "torch_math_fwd_bwd": _fwd_bwd(_torch_math()),
        "torch_math_tpu_fwd_bwd": _fwd_bwd(_torch_math("exact")),
    }
    rng = np.random.default_rng(0)
    report = {}
    for b, hq, hkv, s, d in shapes:
        arr = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)  # noqa: E731
        args = (arr(b, hq, s, d), arr(b, hkv, s, d), arr(b, hkv, s, d))
        shape_rows, ref = {}, None
        for name, fn in rows.items():
            try:
                runs = 3 if name in _SLOW and s >= 8192 else 10
                ms, first, out = timed(fn, *args, runs=runs)
                out = jax.tree_util.tree_map(lambda a: np.asarray(a.astype(jnp.float32)), out)
                if name == "f32_highest":
                    ref = out
                shape_rows[name] = {"ms": ms, "first_s": first, "out": out}
            except Exception as e:  # noqa: BLE001
                shape_rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        eps = float(jnp.finfo(jnp.bfloat16).eps)
        grads = shape_rows.get("exact_qk_fwd_bwd", {}).get("out")
        for name, r in shape_rows.items():
            out = r.pop("out", None)
            if name.endswith("_fwd_bwd"):
                if out is not None and grads is not None:
                    r["grad_diff_eps"] = round(max(map(_share, out, grads)) / eps, 2)
            elif out is not None and ref is not None:
                r["max_diff_eps"] = round(float(np.max(np.abs(out - ref))) / eps, 2)
        if "ms" in shape_rows.get("xla", {}):
            for r in shape_rows.values():
                if "ms" in r:
                    r["vs_xla"] = round(r["ms"] / shape_rows["xla"]["ms"], 2)
        report[f"({b},{hq}/{hkv},{s},{d})"] = shape_rows
        if hlo_dir:
            _dump(rows["torch_math"], args, pathlib.Path(hlo_dir), f"{b}_{hq}_{hkv}_{s}_{d}")
    return report


def _share(got, want) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _dump(fn, args, where: pathlib.Path, tag: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    compiled = jax.jit(fn).lower(*args).compile()
    (where / f"torch_math_{tag}.hlo.txt").write_text(compiled.as_text())
    mem = compiled.memory_analysis()
    if mem is not None:
        fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        stats = {f: getattr(mem, f, None) for f in fields}
        (where / f"torch_math_{tag}.memory.json").write_text(json.dumps(stats))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--hlo", default=None)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print(json.dumps(run(SMALL if args.small else SHAPES, args.hlo), indent=1))


if __name__ == "__main__":
    main()
