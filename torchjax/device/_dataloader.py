"""DataLoader workers without JAX's fork warning.

Note [DataLoader workers and JAX's fork warning]
Once JAX's backends are initialised (the first tpu tensor), jax registers an
``os.register_at_fork(before=...)`` hook that warns "os.fork() was called ... JAX is
multithreaded, so this will likely lead to a deadlock." in the parent at every fork.
``DataLoader(num_workers>0)`` forks its workers (Linux's default start method) at every
epoch, so an ordinary training loop printed the warning although it worked: a forked
worker that runs only CPU torch code never enters JAX, so none of JAX's threads or locks
(not copied into the child) are reached.

Decided: silence exactly that warning, only while torch's worker iterator starts its
workers (``_MultiProcessingDataLoaderIter.__init__``, wrapped; recorded in Note
[Process-wide changes]). Not chosen: making "spawn" or "forkserver" DataLoader's default
context. Both need the dataset, ``collate_fn`` and ``worker_init_fn`` to be picklable and
the script's top level guarded by ``if __name__ == "__main__"``, and they restart an
interpreter per worker: that would break ordinary scripts and notebooks that work now.
A worker that touches tpu tensors (a dataset holding them, a ``collate_fn`` moving
batches to "tpu") would enter JAX in the forked child and deadlock: it raises instead
(Note [tpu tensors after fork] in torchjax/device/_fork.py), naming the ways out (a CPU
dataset, or ``multiprocessing_context="spawn"``). Other forks (``os.fork``,
``multiprocessing`` outside DataLoader) still warn.
"""

from __future__ import annotations

import functools
import warnings

from torchjax import _patches
from torchjax._compat.torch import dataloader_worker_iter

PATCH = "DataLoader worker start"
_FORK_WARNING = r"os\.fork\(\) was called"


def register() -> None:
    cls = dataloader_worker_iter()
    original = cls.__init__
    if getattr(original, "__torchjax_patch__", False):
        return

    @functools.wraps(original)
    def __init__(self, loader, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FORK_WARNING, category=RuntimeWarning)
            original(self, loader, *args, **kwargs)

    __init__.__torchjax_patch__ = True
    _patches.replace_attr(
        cls,
        "__init__",
        __init__,
        name=PATCH,
        why="JAX's fork warning silenced while DataLoader starts CPU-only workers",
        package="torch",
        written_for="2.13",
    )
