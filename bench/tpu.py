"""The TPU run: the TPU test tier and the headline rows on the chip, one results file.

``python -m bench.tpu`` on a TPU machine runs, each section bounded in time:

- ``tier``: ``pytest tests/tpu`` (Note [The TPU tier] in tests/tpu/conftest.py) in a child
  process: its summary line, wall time, slowest tests and failures (its whole output in
  ``<out>.tier.log``);
- ``pallas``: ``pytest tests/pallas`` the same way (every kernel test, on the chip);
- ``precision``: float32 attention and ``exp`` on the chip against float64 on CPU
  (bench/tpu_precision.py);
- ``seed``: a 1.1B-parameter Llama (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab
  32768, seeded weights) saved with ``save_pretrained`` in float32, loaded with
  ``from_pretrained(dir, device_map="tpu")`` with no setting changed, and greedy
  ``generate`` of 32 tokens: the tokens against CPU torch's, load time and time to the
  first result;
- ``numerics``: the same model in bfloat16 (``from_pretrained(..., dtype=torch.bfloat16)``)
  and the same weights in the pure-JAX Llama (bench/jax_llama.py), teacher-forced over one
  256-token sequence, against the float32 model on the chip (torch's "highest" matmul
  precision): each bfloat16 model's distance from float32, how often its argmax agrees
  with float32's, and at the positions where the two bfloat16 models pick different
  tokens, float32's margin between those tokens (a near-tie is a margin within the
  bfloat16 models' own error);
- ``decode``: greedy ``generate`` of 128 tokens after a 128-token prompt at batch 1 and 32
  in bfloat16 (the default path: a static cache, compiled steps, the kernels on) against
  the pure-JAX model's whole loop in one ``jax.jit`` and the HBM roofline (every weight and
  the filled cache read once per step at 819 GB/s); ``TORCHJAX_BENCH_DECODE_BATCHES``
  (comma-separated) runs only those batch sizes;
- ``attention``, ``kernels``: the flash, decode and ragged-dot kernels against jax's own
  TPU kernels, XLA and the roofline (bench/tpu_kernels.py says what each row runs);
- ``moe``: a MoE model that fits the chip, decoding and training with transformers'
  ``grouped_mm`` experts and with torchjax's ragged dot (bench/tpu_moe.py);
- ``compiles``: XLA compile seconds of the Llama's and the MoE's prefill forward per
  layer, of a Pallas kernel at 1 and 16 call sites, of int64 ``cumsum`` and of 32
  KV-cache writes as scatters and as slice writes (bench/tpu_compiles.py);
- ``eager``: plain eager, fused eager (``torchjax.fused()``) and ``torchjax.jit`` of the
  Llama's and the tiny Llama's forward and AdamW step, eager ``generate`` (plain and
  fused) and a chain of 400 small ops: first-call seconds, steady-state time, stats per
  run, fused against plain bit for bit (bench/tpu_eager.py).

Writes the report (markdown) to ``--out`` (default bench/results_tpu.md) and prints it; a
run of some sections replaces those sections of an existing report and keeps the others.

Run:  python -m bench.tpu [--sections tier,pallas,precision,seed,...] [--out PATH]
      [--profile DIR]  (decode: device time per XLA operation of one generate, both models)
      python -m bench.tpu --small     (a small model, to check the script off the chip)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402

import torchjax  # noqa: E402
from bench import jax_llama, tpu_kernels  # noqa: E402
from bench.common import block_torch, header  # noqa: E402

HBM_BYTES_PER_S = 819e9
FLOPS_PER_S = 197e12
SECTIONS = (
    "tier", "pallas", "precision", "seed", "numerics", "decode", "attention", "kernels", "moe",
    "compiles", "eager",
)  # fmt: skip
CHILD_SECTIONS = ("tier", "pallas")  # pytest in a child process, which must hold the chip
TITLE = "torchjax on the chip: bench/tpu.py"


def llama_config(small: bool) -> tf.LlamaConfig:
    if small:
        dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024)
        dims.update(num_attention_heads=4, num_key_value_heads=2)
    else:
        dims = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)
        dims.update(vocab_size=32768, num_attention_heads=32, num_key_value_heads=8)
    return tf.LlamaConfig(
        **dims, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _generate(model, ids, new):
    # The mask made on the host and moved, as a tokenizer's output moved with .to("tpu").
    mask = torch.ones(ids.shape, dtype=ids.dtype).to(ids.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return block_torch(out)


def _prompt(batch, length, vocab, seed=0):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- sections --------------------------------------------------------------------------


def _pytest(ctx, name: str, path: str) -> dict:
    """``pytest path`` in a child process: its summary, wall time, slowest tests and
    failures; its whole output goes to ``<out>.<name>.log``."""
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-rf", "--tb=short", "--durations=8"]
    cmd += ["-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.timeout)
    wall = time.perf_counter() - t0
    ctx.out.with_suffix(f".{name}.log").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr[-500:]
    slow = [ln for ln in lines if " call " in ln or " setup " in ln][:8]
    failed = [ln for ln in lines if ln.startswith("FAILED") or ln.startswith("ERROR")]
    return {"rc": proc.returncode, "wall_s": round(wall, 1), "summary": summary,
            "slowest": slow, "failed": failed}  # fmt: skip


def tier(ctx) -> dict:
    return _pytest(ctx, "tier", "tests/tpu")


def pallas(ctx) -> dict:
    return _pytest(ctx, "pallas", "tests/pallas")


def precision(ctx) -> dict:
    from bench import tpu_precision

    return tpu_precision.precision(ctx)


def seed(ctx) -> dict:
    cfg = llama_config(ctx.small)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    cpu = tf.LlamaForCausalLM(cfg).eval()
    params = sum(p.numel() for p in cpu.parameters())
    cpu.save_pretrained(ctx.dir)
    build_s = time.perf_counter() - t0
    ids = _prompt(1, 32, cfg.vocab_size)
    t0 = time.perf_counter()
    want = _generate(cpu, ids, 32)
    cpu_s = time.perf_counter() - t0
    del cpu
    gc.collect()
    t0 = time.perf_counter()
    model = tf.AutoModelForCausalLM.from_pretrained(ctx.dir, device_map="tpu").eval()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = _generate(model, ids.to("tpu"), 32).cpu()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _generate(model, ids.to("tpu"), 32)
    second_s = time.perf_counter() - t0
    equal = got.shape == want.shape and bool(torch.equal(got, want))
    first_diff = None
    if not equal:
        diff = (got[0, 32:] != want[0, 32:]).nonzero()
        first_diff = int(diff[0]) if len(diff) else None
    ctx.f32 = model
    return {"params": params, "build_and_save_s": round(build_s, 1),
            "cpu_generate_s": round(cpu_s, 1), "from_pretrained_s": round(load_s, 1),
            "first_generate_s": round(first_s, 1),
            "second_generate_s": round(second_s, 2), "tokens_equal_cpu": equal,
            "first_differing_token": first_diff}  # fmt: skip


def _saved(ctx) -> str:
    """The seeded model's checkpoint folder, written here when no earlier section wrote
    it (a run of ``--sections decode`` alone), with the weights ``seed`` saves."""
    if not (pathlib.Path(ctx.dir) / "config.json").exists():
        torch.manual_seed(0)
        tf.LlamaForCausalLM(llama_config(ctx.small)).save_pretrained(ctx.dir)
    return ctx.dir


def _f32(ctx):
    if getattr(ctx, "f32", None) is None:
        ctx.f32 = tf.AutoModelForCausalLM.from_pretrained(_saved(ctx), device_map="tpu").eval()
    return ctx.f32


def _bf16(ctx):
    if getattr(ctx, "bf16", None) is None:
        ctx.bf16 = tf.AutoModelForCausalLM.from_pretrained(
            _saved(ctx), device_map="tpu", dtype=torch.bfloat16
        ).eval()
    return ctx.bf16


def _jax_params(model) -> dict:
    # The torch model's own device arrays (no copy): both run the same weights.
    return {n: torchjax.to_jax(t) for n, t in model.state_dict().items()}


def numerics(ctx) -> dict:
    cfg = llama_config(ctx.small)
    ids = _prompt(1, 256, cfg.vocab_size, seed=1)
    with torch.no_grad():
        ref = _f32(ctx)(ids.to("tpu")).logits.float().cpu()[0]
        model = _bf16(ctx)
        tj = model(ids.to("tpu")).logits.float().cpu()[0]
    jcfg = jax_llama.Config.of(model.config)
    jx = jax.jit(lambda p, i: jax_llama.forward(p, jcfg, i))(
        _jax_params(model), jnp.asarray(ids.numpy())
    )
    jx = torch.from_numpy(np.array(jx.astype(jnp.float32)))[0]
    scale = ref.abs().max().item()
    top = ref.argmax(-1)
    out = {"positions": int(ids.shape[1]), "f32_logit_scale": round(scale, 4)}
    for name, x in (("torchjax_bf16", tj), ("jax_bf16", jx)):
        out[name] = {
            "max_err_rel": round((x - ref).abs().max().item() / scale, 5),
            "mean_err_rel": round((x - ref).abs().mean().item() / scale, 6),
            "argmax_equal_f32": round((x.argmax(-1) == top).float().mean().item(), 4),
        }
    differ = (tj.argmax(-1) != jx.argmax(-1)).nonzero().flatten()
    margins = []
    for p in differ.tolist():
        a, b = int(tj[p].argmax()), int(jx[p].argmax())
        margins.append(abs(ref[p, a] - ref[p, b]).item() / scale)
    out["bf16_models_argmax_differ"] = int(len(differ))
    out["f32_margin_at_differences_rel"] = {
        "median": round(statistics.median(margins), 6) if margins else None,
        "max": round(max(margins), 6) if margins else None,
    }
    # f32 margin between the top two tokens, all positions (how close greedy is to a tie)
    top2 = ref.topk(2, -1).values
    out["f32_top2_margin_rel_median"] = round(
        ((top2[:, 0] - top2[:, 1]) / scale).median().item(), 6
    )
    ctx.f32 = None
    gc.collect()
    return out


def decode(ctx) -> dict:
    cfg = llama_config(ctx.small)
    model = _bf16(ctx)
    params = _jax_params(model)
    jcfg = jax_llama.Config.of(model.config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt, new = 128, (16 if ctx.small else 128)
    rows = {}
    batches = os.environ.get("TORCHJAX_BENCH_DECODE_BATCHES", "1,32")
    for batch in [int(b) for b in batches.split(",") if b.strip()]:
        ids = _prompt(batch, prompt, cfg.vocab_size, seed=2)
        t0 = time.perf_counter()
        _generate(model, ids.to("tpu"), new)
        first = time.perf_counter() - t0
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            got = _generate(model, ids.to("tpu"), new)
            samples.append(time.perf_counter() - t0)
        tj = batch * new / statistics.median(samples)
        fn = jax_llama.jitted(jcfg, new)
        jids = jnp.asarray(ids.numpy())
        mask = jnp.ones_like(jids)
        jax.block_until_ready(fn(params, jids, mask))
        js = []
        for _ in range(3):
            t0 = time.perf_counter()
            jout = jax.block_until_ready(fn(params, jids, mask))
            js.append(time.perf_counter() - t0)
        jx = batch * new / statistics.median(js)
        # per step: every weight once, and the cache filled so far (k and v, all layers)
        kv_per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * jcfg.head_dim * 2
        mean_len = prompt + new / 2
        step_bytes = weight_bytes + batch * mean_len * kv_per_pos
        roof = batch * HBM_BYTES_PER_S / step_bytes
        same = (got.cpu()[:, prompt:] == torch.from_numpy(np.asarray(jout))).float().mean().item()
        if ctx.profile:
            from bench.op_profile import profile

            where = os.path.join(ctx.profile, f"decode_batch{batch}")
            rows[f"profile batch {batch}"] = {
                "torchjax": profile(lambda: _generate(model, ids.to("tpu"), new), 1, where),
                "jax": profile(lambda: jax.block_until_ready(fn(params, jids, mask)), 1,
                               where + "_jax"),
            }  # fmt: skip
        rows[f"batch {batch}"] = {
            "torchjax_tok_s": round(tj, 1), "jax_tok_s": round(jx, 1),
            "ratio_vs_jax": round(tj / jx, 3), "roofline_tok_s": round(roof, 1),
            "fraction_of_roofline": round(tj / roof, 3), "first_generate_s": round(first, 1),
            "tokens_equal_jax_fraction": round(same, 3),
        }  # fmt: skip
    return {"weights_GB": round(weight_bytes / 1e9, 2), "prompt": prompt, "new": new, **rows}


def attention(ctx) -> dict:
    return tpu_kernels.attention(ctx)


def kernels(ctx) -> dict:
    return tpu_kernels.kernels(ctx)


def moe(ctx) -> dict:
    from bench import tpu_moe

    return tpu_moe.moe(ctx)


def compiles(ctx) -> dict:
    from bench import tpu_compiles

    return tpu_compiles.compiles(ctx)


def eager(ctx) -> dict:
    from bench import tpu_eager

    return tpu_eager.eager(ctx)


# -- report ----------------------------------------------------------------------------


def report(results: dict, title: str, earlier: str = "") -> str:
    """The report of ``results``, after the sections of an ``earlier`` report that this
    run did not measure (kept as they were)."""
    kept = []
    for chunk in earlier.split("\n## ")[1:]:
        if chunk.split("\n", 1)[0].strip() not in results:
            kept.append("## " + chunk.rstrip() + "\n")
    lines = [title, ""] + kept
    for name, value in results.items():
        lines += [f"## {name}", "", "```json", json.dumps(value, indent=1), "```", ""]
    return "\n".join(lines)


def _title() -> str:
    kind = next((d.device_kind for d in jax.devices()), "?")
    title = header(TITLE) + f"\ndevice: {kind}"
    print(title, flush=True)
    return title


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results_tpu.md"))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--tier-timeout", type=int, default=480)
    parser.add_argument("--profile", help="decode: device time per XLA operation, traces here")
    args = parser.parse_args(argv)
    ctx = argparse.Namespace(small=args.small, timeout=args.tier_timeout, f32=None, bf16=None)
    ctx.profile = args.profile
    ctx.out = pathlib.Path(args.out)
    earlier = ctx.out.read_text() if ctx.out.exists() else ""
    # A chip has one holder: the test sections' child processes run before this process
    # opens the chip (the header's device query is the first to open it).
    names = args.sections.split(",")
    names = [n for n in names if n in CHILD_SECTIONS] + [
        n for n in names if n not in CHILD_SECTIONS
    ]
    title = None
    results = {}
    with tempfile.TemporaryDirectory() as d:
        ctx.dir = d
        for name in names:
            if name not in CHILD_SECTIONS and title is None:
                title = _title()
            t0 = time.perf_counter()
            try:
                results[name] = globals()[name](ctx)
            except Exception as e:  # noqa: BLE001 - a failed section is reported, the rest run
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            results[name]["section_s"] = round(time.perf_counter() - t0, 1)
            print(f"## {name}\n{json.dumps(results[name], indent=1)}", flush=True)
            # after every section: a run stopped by a time limit keeps what it measured
            ctx.out.write_text(report(results, title or f"# {TITLE}", earlier))
    if title is None:
        ctx.out.write_text(report(results, _title(), earlier))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
