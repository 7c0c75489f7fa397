"""Shared benchmark helpers: a header with versions, and a median timer."""

from __future__ import annotations

import os
import platform
import statistics
import time


def header(title: str) -> str:
    import jax
    import torch

    import torchjax

    try:
        import torchax

        tax = torchax.__version__ if hasattr(torchax, "__version__") else "installed"
    except ImportError:
        tax = "not installed"
    return (
        f"# {title}\n"
        f"torchjax {torchjax.__version__} | torch {torch.__version__} | jax {jax.__version__} "
        f"({jax.default_backend()}, {jax.device_count()} device(s)) | torchax {tax} | "
        f"python {platform.python_version()} | {os.cpu_count()} CPU(s)"
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
