"""``safetensors.torch.load_file(path, device="tpu")`` reads into tpu tensors.

Note [safetensors' load_file onto tpu]
safetensors' reader (Rust) knows the devices it was built for, so ``load_file(path,
device="tpu")``, CUDA's spelling for a tpu, raised ``SafetensorError: device tpu is
invalid``. For a tpu device (``"tpu"``, ``"tpu:N"``, a ``torch.device``) the wrapper
reads with ``torchjax.checkpoint.load_file``, which puts each tensor's bytes straight
into a jax array on that device, one tensor at a time (no torch CPU copy of the file);
the result is safetensors' own: a dict in the file's order, the file's dtypes and
shapes. Every other device, and an integer device (CUDA's index), goes to safetensors'
function unchanged; ``safe_open`` is untouched (transformers and accelerate read tpu
checkpoints through their own glue).
"""

from __future__ import annotations

import functools
import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "0.8"
_TARGET_MODULE = "safetensors.torch"
_NAME = "safetensors.torch.load_file"


def _is_tpu(device) -> bool:
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "tpu"
        except RuntimeError:  # not a device name: safetensors' own error
            return False
    return False


def _wrap_load_file(original):
    @functools.wraps(original)
    def load_file(filename, device="cpu", *, backend="mmap"):
        if not _is_tpu(device):
            return original(filename, device, backend=backend)
        from torchjax import checkpoint

        return checkpoint.load_file(filename, device)

    return load_file


def install() -> None:
    """Wrap ``safetensors.torch.load_file`` (Note [safetensors' load_file onto tpu])."""
    if _patches.is_recorded(_NAME):
        return
    module = sys.modules[_TARGET_MODULE]
    _patches.replace_attr(
        module,
        "load_file",
        _wrap_load_file(module.load_file),
        name=_NAME,
        why="load_file(path, device='tpu') reads into tpu tensors instead of failing in Rust",
        package="safetensors",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if ``safetensors.torch`` is loaded, else right after it is."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="patch safetensors' load_file right after safetensors.torch is imported",
    )
