"""Pinned host memory when the accelerator is "tpu": a plain copy.

Registering a PrivateUse1 backend makes "tpu" torch's current accelerator, so
``DataLoader(pin_memory=True)`` and ``tensor.pin_memory()`` ask it for a pinned-memory
allocator, which a Python backend cannot provide (torch's ``PrivateUse1HooksInterface``
exposes none to Python): both would fail with "implement getPinnedMemoryAllocator".
Pinning exists to speed host-to-device DMA; JAX's transfers do not use torch's pinned
buffers, so the CPU ``_pin_memory`` kernel returns a contiguous copy instead and CPU
code that pins keeps working after ``import torchjax``.
"""

from __future__ import annotations

import torch

_LIB = None


def _pin_memory(self, device=None):
    return self.contiguous().clone()


def register() -> None:
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL", "CPU")
    _LIB.impl("_pin_memory", _pin_memory)
