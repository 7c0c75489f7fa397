"""``Tensor.pin_memory()`` once "tpu" is torch's accelerator.

Registering a PrivateUse1 backend makes "tpu" torch's current accelerator, so
``tensor.pin_memory()`` and ``DataLoader(pin_memory=True)`` (which pins whenever
``torch.accelerator.is_available()``) ask it for a pinned-memory allocator, which a
Python backend cannot provide (torch's ``PrivateUse1HooksInterface`` exposes none to
Python): both would fail with "implement getPinnedMemoryAllocator".

Note [Pinned memory with a tpu accelerator]
A CPU kernel for ``aten::_pin_memory`` decides the target as torch would have without
torchjax: the ``device`` argument, else the runtime accelerator torch detects (CUDA, MTIA,
XPU, MPS, in torch's order). For any such device it runs torch's own kernel
(CompositeExplicitAutograd), so memory is pinned for real, or torch's own error is raised.
When the target is tpu (no other accelerator, or ``device="tpu"``) nothing can be pinned:
JAX copies from any host buffer and never uses torch's pinned buffers. The kernel then
warns that it does so and returns an unpinned copy with the same strides, as pinning
would (``is_pinned()`` stays False, honestly), so DataLoader(pin_memory=True) keeps
working. Recorded in Note [Process-wide changes]; ``torchjax.uninstall()`` destroys the
kernel's library, giving torch's kernel back.
"""

from __future__ import annotations

import warnings

import torch

from torchjax import _patches
from torchjax._compat.torch import call_composite_explicit, destroy_library

_LIB = None
_OP = torch.ops.aten._pin_memory.default


def _host_accelerator() -> torch.device | None:
    """The accelerator torch would pick if "tpu" were not registered (c10's
    getAccelerator order: CUDA, MTIA, XPU, then MPS), or None."""
    for name in ("cuda", "mtia", "xpu"):
        mod = getattr(torch, name, None)
        if mod is not None and mod.is_available():
            return torch.device(name)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return None


def _pin_memory(self, device=None):
    target = torch.device(device) if device is not None else _host_accelerator()
    if target is not None and target.type != "tpu":
        return call_composite_explicit(_OP, self, target)
    warnings.warn(
        "Tensor.pin_memory(): the accelerator is torchjax's 'tpu', which has no pinned host "
        "memory (JAX transfers from any host buffer); returning an unpinned copy "
        "(is_pinned() is False). DataLoader(pin_memory=False) avoids the copy.",
        UserWarning,
        stacklevel=2,
    )
    return torch.empty_strided(self.size(), self.stride(), dtype=self.dtype).copy_(self)


def _undo() -> None:
    global _LIB
    if _LIB is not None:
        destroy_library(_LIB)
        _LIB = None


def register() -> None:
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("aten", "IMPL", "CPU")
    _LIB.impl("_pin_memory", _pin_memory)
    _patches.record(
        "aten::_pin_memory CPU kernel",
        why="pin_memory() asks the tpu accelerator for a pinned allocator it cannot have",
        package="torch",
        written_for="2.13",
        undo=_undo,
    )
