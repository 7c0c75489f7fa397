"""Tensor-parallel loading: parameter bytes per device and peak host memory, TP = 1..8.

    python bench/sharding.py            # a Llama of ~330 MB (bfloat16), 8 simulated devices
    python bench/sharding.py --small    # ~10 MB, seconds: proves the script works

Builds a seeded Llama from its config once and ``save_pretrained``s it to a temporary
directory; then, for each TP size, a fresh process (8 simulated CPU devices,
``--xla_force_host_platform_device_count=8``) loads it with
``torchjax.sharding.load_pretrained`` over a 1-D mesh of TP devices and reports:

- parameter bytes on the fullest device (sum of its addressable shards), which falls as
  1/TP for the sharded weights (norms stay replicated);
- peak host RSS during loading above the RSS before it (sampled every 2 ms), and the
  load time.

On simulated CPU devices device memory *is* host memory, so the peak counts every
device's blocks: it stays near the model size for every TP; what it shows is that
loading adds no full-size host copy on top (``torchjax.checkpoint`` reads one device's
block at a time). On a TPU host the per-device column is what each chip holds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TP_SIZES = (1, 2, 4, 8)


def _config(small: bool):
    from transformers import LlamaConfig

    if small:
        size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=8000)
    else:
        size = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=32000)
    return LlamaConfig(
        **size,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def build(path: str, small: bool) -> int:
    """Save the seeded model to ``path``; return its parameter bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(small), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(path: str, tp: int) -> dict:
    """Load ``path`` with TP=``tp`` in this process; the measurements as a dict."""
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import torchjax
    import torchjax.sharding as ts

    # Warm up what is not loading: JAX's backend, the model's modules (imported lazily
    # by transformers), one meta-device build.
    jax.devices()
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with torchjax.mesh((tp,), ("tp",), devices=jax.devices()[:tp]):
        model = ts.load_pretrained(AutoModelForCausalLM, path)
        arrays = [torchjax.to_jax(p) for p in model.parameters()]
        jax.block_until_ready(arrays)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    per_device: dict = {}
    for arr in arrays:
        for s in arr.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return {
        "tp": tp,
        "bytes_per_device": max(per_device.values()),
        "peak_over_before": max(peak[0], _rss()) - before,
        "load_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a ~10 MB model (seconds)")
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], int(args.worker[1]))), flush=True)
        return

    sys.path.insert(0, str(ROOT))
    from bench.common import child_pythonpath, header

    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=child_pythonpath(),
    )
    print(header("bench/sharding.py: tensor-parallel loading (8 simulated CPU devices)"))
    with tempfile.TemporaryDirectory() as path:
        total = build(path, args.small)
        print(f"model: Llama, {total / 2**20:.1f} MiB of bfloat16 parameters, saved once\n")
        print("| TP | param MiB / device | x full | peak host MiB over start | load s |")
        print("|---:|---:|---:|---:|---:|")
        for tp in TP_SIZES:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", path, str(tp)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"| {tp} | failed: {out.stderr[-2000:]} |")
                continue
            r = json.loads(line[-1][len("RESULT ") :])
            print(
                f"| {tp} | {r['bytes_per_device'] / 2**20:.1f} | "
                f"{r['bytes_per_device'] / total:.3f} | {r['peak_over_before'] / 2**20:.1f} | "
                f"{r['load_s']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
