"""Shared benchmark helpers: a header with versions and load, medians, blocking."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import sys
import time


def child_pythonpath() -> str:
    """PYTHONPATH for a benchmark's child process: the checkout first, then whatever the
    parent had (a TPU VM's setup puts torch and the wheels there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def header(title: str) -> str:
    import jax
    import torch

    import torchjax

    try:
        tax = importlib.metadata.version("torchax") + " (in a child process)"
    except importlib.metadata.PackageNotFoundError:
        tax = "not installed"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"# {title}\n"
        f"torchjax {torchjax.__version__} | torch {torch.__version__} | jax {jax.__version__} "
        f"({jax.default_backend()}, {jax.device_count()} device(s)) | torchax "
        f"{tax} | python {platform.python_version()} | {os.cpu_count()} CPU(s)"
        f" | load average (1, 5, 15 min) {load}"
    )


def median_us(fn, *, warmup: int = 20, runs: int = 200) -> float:
    """Median wall time of ``fn()`` in microseconds (fn must block on its own result)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def block_torch(out):
    """Wait for a torch result on any device: tpu (torchjax), jax (torchax) or CPU."""
    import jax
    import torch

    torchjax = sys.modules.get("torchjax")  # not imported in torchax's child process
    if isinstance(out, torch.Tensor):
        if torchjax is not None and isinstance(out, torchjax.JaxTensor):
            jax.block_until_ready(torchjax.to_jax(out))
        elif hasattr(out, "jax"):  # a torchax tensor
            jax.block_until_ready(out.jax())
        return out
    if isinstance(out, (list, tuple)):
        for o in out:
            block_torch(o)
        return out
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        block_torch(out.to_tuple())
    return out


def fmt_us(us) -> str:
    if isinstance(us, str):
        return us
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"


def ratio(a, b) -> str:
    if isinstance(a, str) or isinstance(b, str):
        return "n/a"
    return f"{a / b:.2f}x"


def lm_train_step(model, opt):
    """One training step of a causal language model on token ids (the ids are the
    labels): forward without a KV cache (a training forward fills none), backward, the
    optimizer's step, zeroed grads; returns the loss, detached. Eager as written; the
    benches wrap it in ``torchjax.jit`` or ``torch.compile``."""

    def step(ids):
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step
