"""Host memory of saving and loading a tpu model, as a multiple of the model's bytes.

Run:  python bench/host_memory.py                 (a ~94M-parameter Llama, bf16 and f32)
      python bench/host_memory.py --layers 24     (a bigger one; on a TPU VM)

Each figure comes from a child process of its own. The child builds the model on tpu,
warms the operation up on a tiny model of the same family (imports, compiled casts),
takes resident memory (VmRSS after ``gc.collect()`` and ``malloc_trim``) as the base,
resets the high-water mark (``/proc/self/clear_refs``), runs the operation and reports
the peak (VmHWM) and what stays (VmRSS after ``gc.collect()``, no trim: what the process
holds, as ``top`` shows it) above the base, divided by the model's bytes.

On CPU JAX a "device" array is host memory, so a model on tpu is already counted in the
base of a save, and a load keeps about 1.0x (the model itself); on a TPU a save's peak
and a load's kept figure should be near 0. Operations: ``save_pretrained`` (one file,
and sharded at a quarter of the model), ``torch.save`` of the state dict,
``safetensors.torch.save_file``, ``torchjax.checkpoint.save_file`` (of the state dict,
and of its matrices transposed: views the host must copy), ``from_pretrained(
device_map="tpu")`` and a tensor-parallel ``from_pretrained`` (``tp_plan="auto"`` over
all devices; on CPU 8 simulated devices).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import child_pythonpath  # noqa: E402

SAVES = (
    "save_pretrained",
    "save_pretrained sharded",
    "torch.save",
    "safetensors",
    "checkpoint",
    "checkpoint transposed",
)
LOADS = ("from_pretrained", "from_pretrained tp")


def _rss(trim: bool) -> float:
    import ctypes
    import gc

    gc.collect()
    if trim:  # memory already freed goes back to the system: the base counts live data
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status("VmRSS")


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


_SAMPLED: list = []  # the sampler's running peak, where clear_refs is not writable


def _reset_peak() -> None:
    """Start the peak from the current resident memory: the kernel's high-water mark
    reset, or (a user who may not write clear_refs, as on a TPU VM) a thread that reads
    VmRSS every millisecond."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
        return
    except PermissionError:
        pass
    import threading
    import time

    _SAMPLED[:] = [_status("VmRSS")]

    def sample():
        while True:
            _SAMPLED[0] = max(_SAMPLED[0], _status("VmRSS"))
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()


def _peak() -> float:
    return _SAMPLED[0] if _SAMPLED else _status("VmHWM")


def _config(layers: int, hidden: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _model(layers: int, hidden: int, dtype):
    import jax
    import torch
    import transformers

    import torchjax

    torch.manual_seed(0)
    with torch.device("tpu"):
        model = transformers.LlamaForCausalLM(_config(layers, hidden)).to(dtype).eval()
    # Every array computed now (a fill or cast may still be pending), so the base counts it.
    jax.block_until_ready([torchjax.to_jax(t) for t in model.state_dict().values()])
    return model


def _save(case: str, model, path: str, nbytes: int) -> None:
    import safetensors.torch
    import torch

    import torchjax

    if case == "save_pretrained":
        model.save_pretrained(path)
    elif case == "save_pretrained sharded":
        model.save_pretrained(path, max_shard_size=max(nbytes // 4, 1))
    elif case == "torch.save":
        torch.save(model.state_dict(), os.path.join(path, "model.pt"))
    elif case == "safetensors":
        safetensors.torch.save_file(model.state_dict(), os.path.join(path, "model.safetensors"))
    elif case == "checkpoint":
        torchjax.checkpoint.save_file(model.state_dict(), os.path.join(path, "model.safetensors"))
    elif case == "checkpoint transposed":
        # Views whose bytes the host must lay out: a copy per tensor even on CPU JAX
        # (where a whole array reaches NumPy without one).
        state = {k: v.t() if v.dim() == 2 else v for k, v in model.state_dict().items()}
        torchjax.checkpoint.save_file(state, os.path.join(path, "model.safetensors"))
    else:
        raise ValueError(case)


def _load(case: str, path: str, dtype):
    import jax
    import transformers

    import torchjax

    if case == "from_pretrained":
        model = transformers.LlamaForCausalLM.from_pretrained(path, device_map="tpu", dtype=dtype)
    else:
        with torchjax.mesh((jax.device_count(),), ("tp",)):
            model = transformers.LlamaForCausalLM.from_pretrained(
                path, device_map="tpu", dtype=dtype, tp_plan="auto"
            )
    jax.block_until_ready([torchjax.to_jax(t) for t in model.state_dict().values()])
    return model


def child(case: str, dtype_name: str, layers: int, hidden: int, scratch: str) -> dict:
    """One measurement in this (fresh) process: {peak, kept, bytes}."""
    import torch

    import torchjax  # noqa: F401  (the "tpu" device)

    dtype = getattr(torch, dtype_name)
    out = {}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        warm, big = os.path.join(tmp, "warm"), os.path.join(tmp, "big")
        os.makedirs(warm)
        os.makedirs(big)
        tiny = _model(1, 64, dtype)
        if case in SAVES:
            _save(case, tiny, warm, 1 << 20)
            del tiny
            model = _model(layers, hidden, dtype)
            nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            base = _rss(trim=True)
            _reset_peak()
            _save(case, model, big, nbytes)
        else:
            tiny.save_pretrained(warm)
            del tiny
            with torch.device("cpu"):
                import transformers

                torch.manual_seed(0)
                cpu = transformers.LlamaForCausalLM(_config(layers, hidden)).to(dtype)
                cpu.save_pretrained(big)
                nbytes = sum(t.numel() * t.element_size() for t in cpu.state_dict().values())
                del cpu
            _load(case, warm, dtype)
            base = _rss(trim=True)
            _reset_peak()
            model = _load(case, big, dtype)
        out["peak"] = (_peak() - base) / nbytes
        out["kept"] = (_rss(trim=False) - base) / nbytes
        # What glibc keeps of freed memory goes back with a trim; what stays is live.
        out["kept_trimmed"] = (_rss(trim=True) - base) / nbytes
        out["bytes"] = nbytes
        del model
    return out


def measure(case: str, dtype: str, layers: int, hidden: int, scratch: str | None = None) -> dict:
    """``child`` in a fresh process (8 simulated CPU devices for the TP load on CPU)."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    if case == "from_pretrained tp" and env.get("JAX_PLATFORMS", "cpu") == "cpu":
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    args = [case, dtype, layers, hidden, scratch or tempfile.gettempdir()]
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{case} ({dtype}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--cases", default=",".join(SAVES + LOADS))
    p.add_argument("--scratch", default=None, help="where files are written")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    rows = [
        "| operation | dtype | model MB | peak | kept | kept after malloc_trim |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            got = measure(case, dtype, args.layers, args.hidden, args.scratch)
            rows.append(
                f"| {case} | {dtype} | {got['bytes'] / 1e6:.0f} | {got['peak']:.2f}x "
                f"| {got['kept']:.2f}x | {got['kept_trimmed']:.2f}x |"
            )
            print(rows[-1], flush=True)
    # The header asks JAX for its devices, which opens the chip: only after the children,
    # since a TPU has one holder at a time.
    from bench.common import header

    print(header("Host memory of save and load, as a multiple of the model's bytes"))
    print(
        "peak: VmHWM above the resident memory just before; kept: VmRSS after, same base; "
        "after malloc_trim: what glibc held of freed memory returned\n"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
