"""``safetensors.torch.load_file(path, device="tpu")`` reads into tpu tensors;
``save_file`` (and ``save_model``, which calls it) write tpu tensors one at a time.

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

Note [safetensors' save_file of tpu tensors]
safetensors' ``save_file`` copies every tensor to CPU (``tensor.to("cpu")``) and keeps
all the copies until its Rust writer has read them: a tpu model sat whole on the host
while saving. When any value is a tpu tensor the wrapper runs safetensors' own refusals
(``_evaluate_tensors_for_save``: not a tensor, sparse, shared memory; then its
non-contiguous check) and writes with torchjax.checkpoint's streaming writer (Note
[Streaming safetensors writes] in torchjax/checkpoint/_writer.py): the same bytes, one
tensor on the host at a time. A dict of CPU tensors only goes to safetensors unchanged.
``save_model`` finds the wrapper through the module, so it streams too; transformers
binds ``save_file`` at import, and wraps its own name with ``wrap_save_file``
(Note [Patching transformers' loading and saving]).
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
_SAVE_NAME = "safetensors.torch.save_file"


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


def _any_tpu(tensors) -> bool:
    return isinstance(tensors, dict) and any(
        isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in tensors.values()
    )


def wrap_save_file(original):
    """``original`` (safetensors.torch's ``save_file``, or a name bound to it) streaming
    tpu tensors (Note [safetensors' save_file of tpu tensors])."""

    @functools.wraps(original)
    def save_file(tensors, filename, metadata=None):
        if not _any_tpu(tensors):
            return original(tensors, filename, metadata=metadata)
        from safetensors.torch import _evaluate_tensors_for_save

        from torchjax.checkpoint import _writer
        from torchjax.checkpoint._save import to_numpy

        _evaluate_tensors_for_save(tensors)
        for name, t in tensors.items():
            if not t.is_contiguous():  # safetensors' message (_flatten_as_ptr)
                raise ValueError(
                    f"You are trying to save a non contiguous tensor: `{name}` which is not "
                    "allowed. It either means you are trying to save tensors which are "
                    "reference of each other in which case it's recommended to save only the "
                    "full tensors, and reslice at load time, or simply call `.contiguous()` "
                    "on your tensor to pack it before saving."
                )
        if metadata is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError("safetensors save_file: metadata keys and values must be str")
        _writer.write(filename, tensors, metadata, to_numpy)

    save_file.__torchjax_patch__ = original
    return save_file


def install() -> None:
    """Wrap ``safetensors.torch.load_file`` (Note [safetensors' load_file onto tpu]) and
    ``save_file`` (Note [safetensors' save_file of tpu tensors])."""
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
    _patches.replace_attr(
        module,
        "save_file",
        wrap_save_file(module.save_file),
        name=_SAVE_NAME,
        why="save_file of tpu tensors writes one tensor at a time, not all copied to CPU",
        package="safetensors",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if ``safetensors.torch`` is loaded, else right after it is."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="patch safetensors' load_file and save_file right after safetensors.torch is imported",
    )
