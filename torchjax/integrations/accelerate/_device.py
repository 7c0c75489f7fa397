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
unchanged: accelerate reads those before it asks ``default_device``. Multi-process
launches (``LOCAL_RANK``) take accelerate's distributed path, which this does not reach.
"""

from __future__ import annotations

import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "1.15"
_TARGET_MODULE = "accelerate.state"
_NAME = "accelerate PartialState.default_device"


def _tpu_is_the_accelerator() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _wrap_default_device(original: property) -> property:
    def default_device(self) -> torch.device:
        device = original.fget(self)
        if device.type == "cpu" and _tpu_is_the_accelerator():
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


def install_when_imported() -> None:
    """``install()`` now if accelerate's state module is loaded, else right after it is."""
    if _after_import.when_imported(_TARGET_MODULE, install):
        _patches.record(
            "sys.meta_path import hook for accelerate",
            why="patch accelerate's device right after accelerate.state is imported",
            package=None,
            written_for=None,
            undo=lambda: _after_import.remove_hooks(_TARGET_MODULE),
        )
