"""tpu tensors in a forked child process: a clear error instead of a deadlock.

Note [tpu tensors after fork]
JAX's runtime (its CPU client, a TPU or GPU client) runs thread pools; ``os.fork()``
copies only the forking thread, so in the child any computation that waits on one of
those threads (compiling, the compilation cache, most transfers) blocks forever. A
``DataLoader(num_workers>0)`` forks its workers (Linux's default start method), so a
dataset holding tpu tensors, or a ``collate_fn`` moving batches to "tpu", hung the
training loop with no message. CUDA refuses the same thing ("Cannot re-initialize CUDA in
forked subprocess"); so does torchjax: a child forked after the parent started JAX's
runtime raises at its first op on a tpu tensor or first new tpu tensor, naming the op
and the ways out (a CPU dataset, moving batches in the main process, the "spawn" start
method, with which tpu tensors cross processes by value; Note [Saving tpu tensors]).
A child forked before JAX started (an ``import torchjax`` with no tpu tensor yet) starts
its own runtime, as a fresh process does. The hook runs only in children, so nothing is
checked on the parent's op path: the child's ``JaxTensor.__torch_dispatch__`` is
replaced, and ``jax_device`` (where every new tpu tensor gets its device) reads the flag.
A child of a process running JAX that leaves through normal interpreter shutdown (not
``os._exit``, which multiprocessing's children use) still blocks in the runtime's
destructors: that is JAX's own behaviour, with or without torchjax.
"""

from __future__ import annotations

import os

from torchjax._compat.jax import backends_initialized
from torchjax.tensor._tensor import JaxTensor

FORKED = [False]


def error(what: str) -> RuntimeError:
    return RuntimeError(
        f"torchjax: {what} in a forked child process: JAX's runtime threads do not survive "
        "fork(), so it would block forever. In a DataLoader with num_workers > 0, keep "
        'the dataset on CPU and move batches to "tpu" in the main process, or pass '
        'multiprocessing_context="spawn"; with multiprocessing, use the "spawn" start '
        "method (tpu tensors are then sent by value)."
    )


def _refuse(cls, func, types, args=(), kwargs=None):
    raise error(f"cannot run {func} on a tpu tensor")


def _after_fork_in_child() -> None:
    if not backends_initialized():
        return
    FORKED[0] = True
    JaxTensor.__torch_dispatch__ = classmethod(_refuse)


_REGISTERED = [False]


def register() -> None:
    if not _REGISTERED[0] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _REGISTERED[0] = True
