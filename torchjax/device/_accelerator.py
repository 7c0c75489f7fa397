"""``torch.accelerator``'s memory functions and ``synchronize`` when tpu is the accelerator.

Note [torch.accelerator on tpu]
``torch.accelerator``'s memory functions (``empty_cache``, ``memory_allocated``,
``memory_stats``, ``get_memory_info``, ...) ask the device's C++ caching allocator, which a
Python backend does not have: torch stops at an internal assert ("Allocator for tpu is not
a DeviceAllocator"), whatever the call. ``torch.accelerator.synchronize()`` raises
"Backend doesn't support synchronizing all streams on device". Libraries call these for
whatever the accelerator is: accelerate 1.16's ``clear_device_cache`` calls
``torch.accelerator.empty_cache()`` from ``set_module_tensor_to_device``, so every
``device_map`` load and every offload hook crashed on a machine whose accelerator is tpu.
Each function is wrapped: when the device it is asked about is tpu (torch's current
accelerator, or a tpu device passed in) it answers with ``torch.tpu``'s function of the
same meaning (device/_module.py); otherwise torch's own runs. Signatures unchanged.
"""

from __future__ import annotations

import collections
import functools

import torch

from torchjax import _patches
from torchjax.device import _module

_NAME = "torch.accelerator memory functions and synchronize"


def _no_op(device=None) -> None:
    return None


def _stats(device=None):
    return collections.OrderedDict(_module.memory_stats(device))


# torch.accelerator name -> the tpu function answering it (None: no device argument).
_TPU_FUNCTIONS = {
    "empty_cache": lambda: _module.empty_cache(),
    "get_memory_info": _module.mem_get_info,
    "max_memory_allocated": _module.max_memory_allocated,
    # JAX reports no peak of reserved memory: the current figure, as max_memory_allocated
    # does where no peak is reported.
    "max_memory_reserved": _module.memory_reserved,
    "memory_allocated": _module.memory_allocated,
    "memory_reserved": _module.memory_reserved,
    "memory_stats": _stats,
    # Nothing accumulates that could be reset (JAX keeps no such counters).
    "reset_accumulated_memory_stats": _no_op,
    "reset_peak_memory_stats": _module.reset_peak_memory_stats,
    "synchronize": _module.synchronize,
}


def _asks_tpu(args) -> bool:
    if args and args[0] is not None and not isinstance(args[0], int):
        return torch.device(args[0]).type == "tpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _wrap(name, original):
    tpu_function = _TPU_FUNCTIONS[name]

    @functools.wraps(original)
    def wrapper(*args):
        if _asks_tpu(args):
            return tpu_function(*args)
        return original(*args)

    return wrapper


def register() -> None:
    """Wrap the functions in ``torch.accelerator`` and ``torch.accelerator.memory`` (where
    torch defines them); idempotent."""
    if _patches.is_recorded(_NAME):
        return
    import torch.accelerator.memory as memory

    originals = {name: getattr(torch.accelerator, name) for name in _TPU_FUNCTIONS}
    wrapped = {name: _wrap(name, fn) for name, fn in originals.items()}
    undo_memory = {name: getattr(memory, name) for name in _TPU_FUNCTIONS if hasattr(memory, name)}
    for name, fn in wrapped.items():
        setattr(torch.accelerator, name, fn)
        if name in undo_memory:
            setattr(memory, name, fn)

    def undo():
        for name, fn in originals.items():
            setattr(torch.accelerator, name, fn)
        for name, fn in undo_memory.items():
            setattr(memory, name, fn)

    _patches.record(
        _NAME,
        why="torch.accelerator's memory functions and synchronize answer for tpu instead "
        "of stopping at torch's allocator assert",
        package="torch",
        written_for="2.13",
        undo=undo,
    )
