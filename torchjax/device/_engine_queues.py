"""Every backward runs its tpu nodes on the thread that called it.

Note [Autograd device queues]
torch's autograd engine gives every device index of a non-CPU device type a ready queue
and a worker thread, and runs each node on the queue of its device while autograd
multithreading is on (the default). Two things go wrong when tpu nodes run on such a
thread:

- The engine sizes the queues once, at the process's first backward, from the device
  count of each device guard registered then (``Engine::start_device_threads``, under a
  ``call_once``). A backward run before ``import torchjax`` leaves no tpu queue, for
  good, and every later backward reaching a tpu node stopped at torch's internal assert
  ("device_ready_queues_ ... INTERNAL ASSERT FAILED"); torch cannot size them again.
- A tpu tensor is a Python object, so the tpu thread runs Python: the lowerings, the
  user's hooks, and the release of the pass's tensors and nodes, which it finishes after
  the caller already holds its result. When the caller's script ended in that window,
  the interpreter was finalizing when that thread next took the GIL; CPython ends such a
  thread with ``pthread_exit``, whose unwinding through a ``noexcept`` C++ destructor
  aborted the process at exit ("terminate called without an active exception",
  SIGABRT), about once in a few thousand processes on a loaded machine (the pattern of
  pytorch#38228: a C++ thread calling Python at shutdown).

So every ``backward()`` and ``torch.autograd.grad`` after ``import torchjax`` runs with
multithreading off (``torch.autograd.set_multithreading_enabled(False)``, thread-local,
set for the call): the engine runs every node on the calling thread's CPU queue and
never asks for a tpu queue, whichever came first, backward or import. CPU nodes run
there in any case, so CPU results and the order of hooks do not change; tpu nodes lose
nothing, as a JAX dispatch is asynchronous on any thread. ``torchjax.jit``,
``torch.compile(backend="tpu")`` and fused eager mode run their backward this way for
their own reasons. In a process that also has CUDA, its nodes run on the calling thread
too while torchjax is installed (torch's own multithreading-off mode, same results);
``torchjax.uninstall()`` gives torch's entry back.
"""

from __future__ import annotations

import threading

import torch

from torchjax._compat.torch_engine import install_backward_entry

# A callable ``(args, kwargs)`` per thread, shown every backward's arguments before it
# runs: a compiled function's trace notes the leaves it accumulates into (Note
# [Gradients that escape a trace] in torchjax/compile/_escaped_grads.py).
BEFORE_BACKWARD = threading.local()


def _run_backward(original, *args, **kwargs):
    observe = getattr(BEFORE_BACKWARD, "fn", None)
    if observe is not None:
        observe(args, kwargs)
    with torch.autograd.set_multithreading_enabled(False):
        return original(*args, **kwargs)


def register() -> None:
    install_backward_entry(_run_backward)
