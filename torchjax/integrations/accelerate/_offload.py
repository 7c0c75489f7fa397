"""Disk-offloaded weights read back for a model whose execution device is tpu.

Note [Offloaded weights onto tpu]
With ``device_map=`` entries on "disk", accelerate's hooks read each offloaded weight
per forward through ``OffloadedWeightsLoader[key]``, which opens the safetensors file
with ``safe_open(..., device=<execution device>)``. safetensors' reader only knows the
devices it was built for, so "tpu" fails in Rust ("device tpu is invalid"; accelerate's
CPU retry only catches ``TypeError``). For a tpu loader the wrapper reads the tensor on
CPU through accelerate's own code and moves it to tpu, which is what accelerate does when
the reader hands back a tensor on another device. Other loaders are unchanged.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "1.16"
_TARGET_MODULE = "accelerate.utils.offload"
_NAME = "accelerate OffloadedWeightsLoader.__getitem__"


def _reads_safetensors_to_tpu(loader, key: str) -> bool:
    if loader.device is None or torch.device(loader.device).type != "tpu":
        return False
    if key in loader.state_dict:
        return False
    return loader.index.get(key, {}).get("safetensors_file") is not None


def _wrap_getitem(original):
    @functools.wraps(original)
    def __getitem__(self, key: str):
        if not _reads_safetensors_to_tpu(self, key):
            return original(self, key)
        on_cpu = copy.copy(self)  # a shallow copy: the loader itself is shared by hooks
        on_cpu.device = "cpu"
        return original(on_cpu, key).to(self.device)

    return __getitem__


def install() -> None:
    """Wrap ``OffloadedWeightsLoader.__getitem__`` (Note [Offloaded weights onto tpu])."""
    if _patches.is_recorded(_NAME):
        return
    cls = sys.modules[_TARGET_MODULE].OffloadedWeightsLoader
    _patches.replace_attr(
        cls,
        "__getitem__",
        _wrap_getitem(cls.__dict__["__getitem__"]),
        name=_NAME,
        why="disk-offloaded weights read to CPU, then moved to their tpu execution device",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if accelerate's offload module is loaded, else right after it is."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="patch accelerate's offloaded-weight reads right after the module is imported",
    )
