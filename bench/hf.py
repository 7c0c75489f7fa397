"""Hugging Face on "tpu": load, decode and diffusion-step figures, in one run.

1. Load: ``AutoModelForCausalLM.from_pretrained(path)`` to CPU vs ``device_map="tpu"``
   of a float32 Llama checkpoint (``LOAD_CONFIG``, written once with save_pretrained),
   each in a fresh child process: wall time, and peak resident memory above the child's
   resident memory just before the call (``ru_maxrss``; on this jax CPU backend, device
   arrays live in host memory too, so the figure includes the loaded weights).
2. Greedy decode tokens/s of the tiny Llama (bench/models.py, the examples' config),
   batch 1, prompt ``bench.decode.PROMPT``, ``NEW_TOKENS`` new tokens, median of ``RUNS``
   generations after one warm-up generation: torch CPU and torchjax eager with the
   default DynamicCache (``disable_compile=True`` on tpu); torchjax's default (the call
   as written: a static cache and the decode programs); torchjax compiled with a static
   cache through ``compile_generate`` (torchjax.jit) and through transformers' own loop around
   ``CompileConfig(backend="tpu")`` (torch.compile; ``TORCHJAX_AUTO_COMPILE_GENERATE=0``,
   else that call runs compile_generate's programs too); torchax eager in a child process
   (bench/_torchax.py, via bench/decode.py), where it runs.
3. Diffusers: one UNet denoising step (the tiny pipeline of examples/diffusers_tpu.py,
   classifier-free-guidance batch 2), median of ``RUNS`` calls: eager vs
   ``unet.compile(backend="tpu", fullgraph=True, dynamic=False)``.
   Pipelines: the tiny SD3, Flux, QwenImage, Wan and LTX-2 pipelines of
   tests/integrations/tiny_pipelines.py (2 steps; the test's sizes), each in a fresh
   child process: wall time of one pipeline call on torch CPU (warm), on tpu eager
   (first call: compiles every op, with the XLA programs it compiled or loaded from the
   persistent cache, ``torchjax.stats()``; then warm, median of ``RUNS``) and with
   ``pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)`` (first
   call: Dynamo capture and the jax compile; second call: the cached executables).
4. Trainer: optimizer steps/s of ``transformers.Trainer`` fine-tuning the tiny Llama of
   examples/hf_trainer.py (batch 4, sequence 8), ``TRAINER_STEPS`` steps after a
   ``TRAINER_STEPS``-step warm-up run in the same process (the warm-up pays the eager
   ops' compiles): torch CPU vs torchjax eager, and with ``torch_compile=True``.

Run:  python bench/hf.py            (LOAD_CONFIG: a ~110M-parameter Llama)
      python bench/hf.py --trainer  (only 4., the Trainer row)
      python bench/hf.py --pipelines (only the diffusers pipelines of 3.)
      python bench/hf.py --quick    (a ~4M-parameter load model, 8 new tokens)
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from bench import _torchax, decode  # noqa: E402
from bench.common import block_torch, fmt_us, header, median_us, ratio  # noqa: E402

NEW_TOKENS = 32
TRAINER_STEPS = 20
RUNS = 5
LOAD_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
QUICK_LOAD_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)  # fmt: skip


# ---- 1. load time and peak memory (child processes) ----


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _load_child(path: str, device: str) -> None:
    """Runs in a child process: prints {"seconds", "peak_mb"} as JSON."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401  (imported before the baseline)

    import torchjax  # noqa: F401

    kwargs = {"device_map": "tpu"} if device == "tpu" else {}
    if device == "tpu":  # start the jax runtime before the baseline: not part of loading
        block_torch(torch.zeros(1, device="tpu") + 1)
    base = _rss_kb()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    block_torch(list(model.parameters()))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_mb": (peak - base) / 1024}))


def load_figures(config: dict) -> dict:
    """{"model_mb", "cpu": {...}, "tpu": {...}}: each device loaded in a fresh process."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config, tie_word_embeddings=False))
    out = {"model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        del model
        for device in ("cpu", "tpu"):
            proc = subprocess.run(
                [sys.executable, __file__, "--load-child", path, device],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not lines:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]
                out[device] = f"n/a ({err})"
            else:
                out[device] = json.loads(lines[-1])
    return out


# ---- 2. greedy decode tokens/s ----


def _tokens_per_s(model, new_tokens: int, **kwargs) -> float:
    ids = torch.tensor(decode.PROMPT).to(model.device)
    return decode.tokens_per_s(model, ids, new_tokens, RUNS, **kwargs)


def decode_figures(new_tokens: int) -> dict:
    from transformers import CompileConfig

    from bench.models import tiny_llama
    from torchjax.integrations.transformers import compile_generate

    out = {"torch CPU": _tokens_per_s(tiny_llama(), new_tokens)}
    out["torchjax eager"] = _tokens_per_s(tiny_llama().to("tpu"), new_tokens, disable_compile=True)
    out["torchjax generate (default: static cache, decode programs)"] = _tokens_per_s(
        tiny_llama().to("tpu"), new_tokens
    )
    model = tiny_llama().to("tpu")
    jitted = compile_generate(model)
    out["torchjax compile_generate (static cache)"] = _tokens_per_s(
        model, new_tokens, cache_implementation="static"
    )
    out["compile_generate traces"] = jitted.trace_count
    config = CompileConfig(backend="tpu", fullgraph=True, dynamic=False)
    # transformers' own loop around torch.compile(backend="tpu"): with the rule of Note
    # [transformers' auto-compile on tpu] on, the call would run compile_generate's programs.
    os.environ["TORCHJAX_AUTO_COMPILE_GENERATE"] = "0"
    try:
        out['torch.compile(backend="tpu") via CompileConfig (static cache)'] = _tokens_per_s(
            tiny_llama().to("tpu"), new_tokens, cache_implementation="static", compile_config=config
        )
    finally:
        del os.environ["TORCHJAX_AUTO_COMPILE_GENERATE"]
    if new_tokens == decode.NEW_TOKENS:  # torchax's child measures decode.NEW_TOKENS
        tax = _torchax.measure("decode")
        out["torchax eager"] = tax.get("decode", tax.get("*", "n/a"))
    else:
        out["torchax eager"] = f"n/a (measured only with {decode.NEW_TOKENS} new tokens)"
    return out


# ---- 3. diffusers UNet step ----


def diffusion_figures() -> dict:
    from examples import diffusers_tpu as dt

    with tempfile.TemporaryDirectory() as path:
        pipe = dt.tiny_pipeline(path)
    pipe.to("tpu")
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, dt.SIZE, dt.SIZE, generator=g).to("tpu")
    context = torch.randn(2, 16, 16, generator=g).to("tpu")  # (batch, tokens, cross-attn dim)
    t = torch.tensor(500).to("tpu")

    def step(unet):
        def fn():
            with torch.no_grad():
                return block_torch(unet(sample, t, encoder_hidden_states=context).sample)

        return fn

    out = {"eager": median_us(step(pipe.unet), warmup=2, runs=RUNS)}
    pipe.unet.compile(backend="tpu", fullgraph=True, dynamic=False)
    t0 = time.perf_counter()
    step(pipe.unet)()
    out["compile (first call)"] = (time.perf_counter() - t0) * 1e6
    out["compiled"] = median_us(step(pipe.unet), warmup=2, runs=RUNS)
    return out


def _pipeline_child(name: str) -> None:
    """Runs in a child process: prints one pipeline's call times (seconds) as JSON."""
    import torchjax
    from tests.integrations import tiny_pipelines as tp

    case = tp.PIPELINES[name]
    pipe = case.build()
    pipe.set_progress_bar_config(disable=True)

    def call() -> float:  # the outputs come back as numpy arrays: the call has finished
        t0 = time.perf_counter()
        case.call(pipe, torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    call()
    out = {"cpu": median_us(call, warmup=0, runs=RUNS) / 1e6}
    pipe.to("tpu")
    before = torchjax.stats()
    out["eager first"] = call()
    after = torchjax.stats()
    # XLA programs the first call compiled (or, with a warm cache, loaded).
    out["eager first programs"] = sum(
        after[k] - before[k] for k in ("compiles", "persistent_cache_hits")
    )
    out["eager"] = median_us(call, warmup=0, runs=RUNS) / 1e6
    pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)
    out["compiled first"] = call()
    out["compiled second"] = call()
    out["compiled"] = median_us(call, warmup=0, runs=RUNS) / 1e6
    print(json.dumps(out))


def pipeline_figures() -> dict:
    """{name: {"cpu", "eager first", "eager", "compiled first", "compiled second",
    "compiled"} in seconds, or a string saying why not}, one child process each."""
    from tests.integrations.tiny_pipelines import PIPELINES

    out = {}
    for name in PIPELINES:
        proc = subprocess.run(
            [sys.executable, __file__, "--pipeline-child", name],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]
            out[name] = f"n/a ({err})"
        else:
            out[name] = json.loads(lines[-1])
    return out


def pipeline_report(figures: dict) -> str:
    lines = [
        "| tiny pipeline, 2 steps, one call | torch CPU | tpu eager, first call | "
        "(XLA programs) | tpu eager | compiled transformer, first call | second call | "
        "compiled (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("cpu", "eager first", "eager", "compiled first", "compiled second", "compiled")
    for name, r in figures.items():
        if isinstance(r, str):
            lines.append(f"| {name} | {r} | | | | | | |")
        else:
            cells = [f"{r[k]:.2f} s" for k in keys]
            cells.insert(2, str(r["eager first programs"]))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- 4. Trainer steps/s ----


def trainer_figures(steps: int) -> dict:
    from examples import hf_trainer

    out = {}
    for name, device, kwargs in (
        ("torch CPU", "cpu", {}),
        ("torchjax eager", "tpu", {}),
        ("torchjax torch_compile=True", "tpu", {"torch_compile": True}),
    ):
        hf_trainer.run(device, steps=steps, **kwargs)  # warm-up: compiles
        _, _, trainer = hf_trainer.run(device, steps=steps, **kwargs)
        out[name] = trainer.state.max_steps / _train_seconds(trainer)
    return out


def _train_seconds(trainer) -> float:
    # The Trainer's own wall time of train(), logged with its final record.
    return next(h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h)


def report(load: dict, dec: dict, diff: dict, new_tokens: int) -> str:
    def f(v, spec):
        return v if isinstance(v, str) else format(v, spec)

    lines = [
        f"| from_pretrained, float32 Llama of {load['model_mb']:.0f} MB | wall time (s) | "
        "peak RSS above baseline (MB) |",
        "|---|---:|---:|",
    ]
    for device, name in (("cpu", "CPU"), ("tpu", 'device_map="tpu"')):
        r = load[device]
        if isinstance(r, str):
            lines.append(f"| {name} | {r} | |")
        else:
            lines.append(f"| {name} | {r['seconds']:.2f} | {r['peak_mb']:.0f} |")
    lines += [
        "",
        f"| tiny Llama greedy decode, batch 1, {new_tokens} new tokens | tokens/s | vs torch CPU |",
        "|---|---:|---:|",
    ]
    cpu = dec["torch CPU"]
    for name, v in dec.items():
        if name == "compile_generate traces":
            continue
        lines.append(f"| {name} | {f(v, '.1f')} | {ratio(v, cpu)} |")
    lines.append(f"\ncompile_generate traces over all runs: {dec['compile_generate traces']}")
    lines += [
        "",
        "| tiny UNet step (CFG batch 2, latents 8x8) | median | speed-up vs eager |",
        "|---|---:|---:|",
        f"| eager | {fmt_us(diff['eager'])} | 1.00x |",
        f'| unet.compile(backend="tpu") | {fmt_us(diff["compiled"])} | '
        f"{ratio(diff['eager'], diff['compiled'])} |",
        f"| (compile, first call) | {fmt_us(diff['compile (first call)'])} | |",
    ]
    return "\n".join(lines)


def trainer_report(steps_per_s: dict, steps: int) -> str:
    cpu = steps_per_s["torch CPU"]
    lines = [
        f"| Trainer, tiny Llama, batch 4 x 8 tokens, {steps} steps | steps/s | vs torch CPU |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {v:.1f} | {ratio(v, cpu)} |" for name, v in steps_per_s.items()]
    return "\n".join(lines)


def main(argv) -> None:
    if argv[:1] == ["--load-child"]:
        _load_child(argv[1], argv[2])
        return
    if argv[:1] == ["--pipeline-child"]:
        _pipeline_child(argv[1])
        return
    if "--pipelines" in argv:
        import torchjax  # noqa: F401

        print(header("Hugging Face on tpu: diffusers pipelines"))
        print(pipeline_report(pipeline_figures()))
        return
    quick = "--quick" in argv
    if "--trainer" in argv:
        import torchjax  # noqa: F401

        print(header("Hugging Face on tpu: Trainer"))
        print(trainer_report(trainer_figures(TRAINER_STEPS), TRAINER_STEPS))
        return
    new_tokens = 8 if quick else NEW_TOKENS
    import torchjax  # noqa: F401

    print(header("Hugging Face on tpu: load, decode, diffusion step"))
    load = load_figures(QUICK_LOAD_CONFIG if quick else LOAD_CONFIG)
    dec = decode_figures(new_tokens)
    diff = diffusion_figures()
    print(report(load, dec, diff, new_tokens))
    print()
    print(pipeline_report(pipeline_figures()))
    steps = 4 if quick else TRAINER_STEPS
    print()
    print(trainer_report(trainer_figures(steps), steps))


if __name__ == "__main__":
    main(sys.argv[1:])
