"""``torch.backends.tpu`` for the ``kernels`` library.

Note [The Kernels Hub backend on tpu]
``kernels`` (0.17) picks the build variant of a kernel repository from the backend it
detects: TPU when ``torch.backends.tpu`` exists (torch_tpu sets it at import), else from
``torch.version.cuda``/``hip``, MPS, XPU, and CPU last. torchjax makes "tpu" a torch
device but torch has no ``torch.backends.tpu``, so ``kernels`` saw CPU: a repository's
``build/torch-tpu`` variant was rejected ("backend (tpu) does not match system backend
(cpu)") and ``get_local_kernel``/``LayerRepository.load`` could only load a CPU build.
Right after ``kernels`` is imported, ``torch.backends.tpu`` is set to a small module with
the ``is_available()``/``is_built()`` pair every ``torch.backends.<name>`` has (and put in
``sys.modules``, so ``import torch.backends.tpu`` works too). It is nothing else: no
library in the test environment reads more of it. When something already set
``torch.backends.tpu`` (torch_tpu itself) it is left alone. ``kernelize(model,
device="tpu")`` needs nothing more: ``kernels`` knows the "tpu" device type, and with no
``device`` it reads the parameters' device, which is "tpu".
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "0.17"
_TARGET_MODULE = "kernels"
_MODULE_NAME = "torch.backends.tpu"


def is_available() -> bool:
    """True when a tpu device can be used (``torch.tpu.is_available()``)."""
    return torch.tpu.is_available()


def is_built() -> bool:
    """True: torchjax's tpu backend is part of this process."""
    return True


def _module() -> types.ModuleType:
    module = types.ModuleType(
        _MODULE_NAME, "torchjax's tpu backend (Note [The Kernels Hub backend on tpu])."
    )
    module.is_available = is_available
    module.is_built = is_built
    return module


def _undo(module: types.ModuleType) -> None:
    # Only torchjax's module is taken away; one set after it stays.
    if sys.modules.get(_MODULE_NAME) is module:
        del sys.modules[_MODULE_NAME]
    if getattr(torch.backends, "tpu", None) is module:
        del torch.backends.tpu


def install() -> None:
    """Set ``torch.backends.tpu`` (Note [The Kernels Hub backend on tpu]); idempotent."""
    if hasattr(torch.backends, "tpu"):
        return  # torchjax's own (already recorded) or torch_tpu's: keep it
    module = _module()
    torch.backends.tpu = module
    sys.modules[_MODULE_NAME] = module
    _patches.record(
        _MODULE_NAME,
        why="kernels selects the tpu build variant when torch.backends.tpu exists",
        package="kernels",
        written_for=PATCHED_FOR,
        undo=functools.partial(_undo, module),
    )


def install_when_imported() -> None:
    """``install()`` once ``kernels`` is imported, never importing it."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="sets torch.backends.tpu right after kernels is imported",
    )
