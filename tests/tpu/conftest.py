"""The TPU tier: what only the chip can show, in few programs.

Note [The TPU tier]
The CPU suite proves semantics with thousands of tiny programs; on a TPU each of them is a
compile for the chip (four of its files ran 4 tests in 330 s there), so the chip gets its
own tier, run in one process in a few minutes: ``python -m pytest tests/tpu`` (or
``python -m bench.tpu``, which runs it and the headline benchmarks and writes a results
file). It holds what differs on the chip: Mosaic compiling every Pallas kernel, XLA:TPU's
float32 precision settings and transcendental functions, bfloat16 numerics, the default
SDPA path taking the kernels, and whole workflows (transformers models through
``from_pretrained(device_map="tpu")`` and ``generate``, a diffusers pipeline with a
compiled transformer, the Trainer, a ``torch.compile`` train step, checkpoints, a Kernels
Hub kernel), each against CPU torch on the same inputs.

Every test here is skipped unless JAX's default backend is a TPU, so CI (no accelerator)
collects and skips them. ``TORCHJAX_TPU_TIER=1`` runs them on any backend, to check the
tier's own logic on a CPU (kernels then run in interpret mode; add
``TORCHJAX_FLASH_ATTENTION=1`` there, since the SDPA checks expect the chip's default of
taking the kernels). On the chip the suite's
CPU compile flags are not set (tests/conftest.py), which the first test asserts: the tier
compiles as user code does.
"""

from __future__ import annotations

import os

import jax
import pytest

FORCED = os.environ.get("TORCHJAX_TPU_TIER", "") == "1"


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


@pytest.fixture(autouse=True)
def _tpu_only():
    if not (on_tpu() or FORCED):
        pytest.skip(
            f"TPU tier: JAX's backend is {jax.default_backend()!r}, not a TPU "
            "(TORCHJAX_TPU_TIER=1 runs it anyway)"
        )
