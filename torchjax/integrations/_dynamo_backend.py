"""``torch.compile(backend="tpu")`` finds torchjax's backend without its package metadata.

Note [Finding the "tpu" Dynamo backend]
Dynamo looks a backend named by a string up in its registry, which holds its own backends
and, at the first miss, the ``torch_dynamo_backends`` entry points of the installed
distributions. pyproject.toml declares "tpu" there, so ``import torchjax`` never imports
Dynamo. But a torchjax importable without its distribution's metadata (a checkout on
``PYTHONPATH``, as the TPU VM's setup runs it; a vendored copy) had no "tpu" backend:
``torch.compile(..., backend="tpu")`` raised ``InvalidBackend`` on the chip. So the same
function is also registered with Dynamo's public ``register_backend`` right after
``torch._dynamo`` is imported (or at ``import torchjax``, if it is loaded already), which
costs nothing for a program that never compiles. The registered function is
``torchjax.compile._dynamo.backend``, imported at registration as an entry point's lookup
imports it (its import installs what Dynamo's tracing of tpu tensors needs); only when
that module is the one importing Dynamo (half made: a circular import) is a function
registered that imports it at the first graph, by when the module is complete. Where
the entry point exists as well, Dynamo takes the registered function first (a lookup
loads an entry point only for a name with no function yet). Undo: the
name is taken off the registry, and the entry point (if any) serves it again.
"""

from __future__ import annotations

import importlib
import sys

from torchjax import _patches
from torchjax._compat import torch_dynamo
from torchjax.integrations import _after_import

NAME = "tpu"
_MODULE = "torchjax.compile._dynamo"
_RECORD = "torch._dynamo backend 'tpu'"


def tpu(gm, example_inputs, **kwargs):
    """The "tpu" backend, ``torchjax.compile._dynamo.backend``, imported at the first
    graph: this registers while ``torch._dynamo`` finishes importing, which may be part
    of importing that very module (``torchjax.compile.dynamo_stats()`` imports it)."""
    from torchjax.compile._dynamo import backend

    return backend(gm, example_inputs, **kwargs)


def install() -> None:
    """Register the "tpu" backend with Dynamo (Note [Finding the "tpu" Dynamo backend])."""
    if _patches.is_recorded(_RECORD):
        return
    # The module's import installs what Dynamo's tracing of tpu tensors needs (its skip
    # rules, the fake-tensor patches), so it is imported now, as an entry point's lookup
    # would; only while that module is itself importing Dynamo (half made) is the
    # function that imports it at the first graph registered instead.
    module = sys.modules.get(_MODULE)
    if module is None:
        module = importlib.import_module(_MODULE)
    fn = getattr(module, "backend", None) or tpu
    if not torch_dynamo.register_dynamo_backend(NAME, fn):
        return  # an entry point already loaded it (or another "tpu" backend exists)
    _patches.record(
        _RECORD,
        why="torch.compile(backend='tpu') where torchjax has no installed entry point",
        package="torch",
        written_for="2.13",
        undo=lambda: torch_dynamo.unregister_dynamo_backend(NAME, fn),
    )


def install_when_imported() -> None:
    """``install()`` now if Dynamo is loaded, else right after ``torch._dynamo`` is."""
    _after_import.when_imported(
        "torch._dynamo",
        install,
        why="register the 'tpu' backend with Dynamo right after it is imported",
    )
