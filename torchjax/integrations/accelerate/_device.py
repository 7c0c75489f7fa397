"""accelerate's default device on a machine whose torch accelerator is "tpu".

Note [accelerate's device on tpu]
accelerate picks its device from a fixed list of backends it knows
(``PartialState.default_device``: mps, mlu, sdaa, musa, npu, hpu, cuda, xpu, neuron, else
cpu); it never asks ``torch.accelerator``. transformers does: ``TrainingArguments.device``
is ``tpu:0`` (``is_torch_tpu_available()``), so ``Trainer`` moved the model to tpu while
``Accelerator.prepare(dataloader)`` moved every batch to accelerate's device, cpu, and the
first op failed ("Expected all tensors to be on the same device ... tpu:0 and cpu (in
aten::embedding)"). The wrapped property answers what accelerate's list answers, except
that its "cpu" fallback becomes ``tpu:<current index>`` when ``torch.accelerator`` reports
tpu. ``Accelerator(cpu=True)``, ``use_cpu=True`` and ``ACCELERATE_TORCH_DEVICE`` are
unchanged: accelerate reads those before it asks ``default_device``. accelerate 1.16 asks
``torch.accelerator`` itself and answers ``tpu`` without an index; the property adds the
current index, so accelerate's device is ``tpu:0`` on every release, as transformers' is.
Multi-process launches (``LOCAL_RANK``) take accelerate's distributed path, which this does
not reach.

``device_map="auto"`` sizes devices with accelerate's ``get_max_memory()``, which lists
the same known backends and so offers only cpu (and disk): a tiny model loaded
"auto" stayed on cpu. transformers calls it as
``transformers.integrations.accelerate.accelerate_max_memory``; that name is wrapped so
that, with no ``max_memory`` given and tpu as torch's accelerator, every tpu device is
offered first with its free memory (``torch.tpu.mem_get_info``), under the integer key
that ``torch.device(i)`` resolves to ``tpu:i``. A ``max_memory`` the user passes
(``{0: "2GiB", "cpu": ...}``) already works and goes through unchanged.
"""

from __future__ import annotations

import functools
import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "1.16"
_TARGET_MODULE = "accelerate.state"
_NAME = "accelerate PartialState.default_device"
_MEMORY_TARGET = "transformers.integrations.accelerate"
_MEMORY_NAME = "transformers accelerate_max_memory"


def tpu_is_the_accelerator() -> bool:
    """True when torch's current accelerator is tpu (what transformers asks)."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _wrap_default_device(original: property) -> property:
    def default_device(self) -> torch.device:
        device = original.fget(self)
        if (device.type == "cpu" and tpu_is_the_accelerator()) or (
            device.type == "tpu" and device.index is None
        ):
            return torch.device("tpu", torch.accelerator.current_device_index())
        return device

    default_device.__doc__ = original.__doc__
    return property(default_device)


def install() -> None:
    """Wrap ``PartialState.default_device`` (Note [accelerate's device on tpu]); idempotent."""
    if _patches.is_recorded(_NAME):
        return
    state = sys.modules[_TARGET_MODULE]
    cls = state.PartialState
    _patches.replace_attr(
        cls,
        "default_device",
        _wrap_default_device(cls.__dict__["default_device"]),
        name=_NAME,
        why="accelerate's device is tpu when torch.accelerator is tpu, as transformers' is",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


def _wrap_max_memory(original):
    @functools.wraps(original)
    def get_max_memory(max_memory=None):
        found = original(max_memory)
        if max_memory is not None or not tpu_is_the_accelerator():
            return found
        if any(isinstance(k, int) for k in found):
            return found  # accelerate found devices of its own (cuda, ...)
        tpus = {i: torch.tpu.mem_get_info(i)[0] for i in range(torch.tpu.device_count())}
        return {**tpus, **found}

    return get_max_memory


def install_max_memory() -> None:
    """Wrap the ``get_max_memory`` transformers' ``device_map="auto"`` calls; idempotent."""
    if _patches.is_recorded(_MEMORY_NAME):
        return
    module = sys.modules[_MEMORY_TARGET]
    if not hasattr(module, "accelerate_max_memory"):
        return  # transformers without accelerate: no "auto" device map to size
    _patches.replace_attr(
        module,
        "accelerate_max_memory",
        _wrap_max_memory(module.accelerate_max_memory),
        name=_MEMORY_NAME,
        why='device_map="auto" offers the tpu devices (accelerate lists only its backends)',
        package="transformers",
        written_for="5.24",
    )


def install_when_imported() -> None:
    """Both wraps now if their modules are loaded, else right after each is."""
    for target, install_one in ((_TARGET_MODULE, install), (_MEMORY_TARGET, install_max_memory)):
        _after_import.when_imported(
            target,
            install_one,
            why="patch accelerate's device choice right after the module is imported",
        )
