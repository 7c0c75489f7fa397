"""Backward on tpu after a backward that ran before ``import torchjax``.

Note [Autograd device queues]
torch's autograd engine gives every device index of a non-CPU device type a ready queue
and a worker thread. It sizes them once, at the process's first backward, from the
device count of each device guard registered then (``Engine::start_device_threads``,
run under a ``call_once``). A backward run before ``import torchjax`` registered the tpu
device guard therefore leaves no queue for tpu, for good, and every later backward that
reaches a tpu node stopped at torch's internal assert ("device_ready_queues_ ... INTERNAL
ASSERT FAILED"); torch has no way to size them again. The queues are used only while
autograd multithreading is on: with it off (``torch.autograd.set_multithreading_enabled
(False)``, thread-local) the engine runs every node on the calling thread's CPU queue,
as fused eager mode already does for its own reasons.

So the first backward after ``import torchjax`` (``backward()`` or ``autograd.grad``,
any device) first asks the engine for a tpu queue with a probe: a graph of one tpu
tensor (a plain PrivateUse1 tensor with no memory: no JAX work) whose backward does
nothing. Where the engine has the queue (the usual order, where its threads start in
this very call), the probe's backward runs on the tpu thread and nothing changes. Where
it has none, every backward from then on runs with multithreading off in its calling
thread, so tpu nodes run where CPU nodes run (and CUDA's, in a process that has CUDA).
The probe waits for the first backward because probing at import would start the
engine's threads, and JAX (the engine asks the tpu guard for its device count), at
import: torch refuses autograd in a child forked after the threads start, torchjax tpu
work after JAX starts. It runs with the dispatch modes of the caller's stack off (a
backward traced by make_fx or under a fake mode must not record it) and with
multithreading on (off, the CPU queue would answer for the tpu one).
"""

from __future__ import annotations

import threading

import torch

from torchjax._compat.torch import create_empty_tensor
from torchjax._compat.torch_engine import (
    grad_of,
    install_backward_entry,
    lacks_device_queue,
    without_dispatch_modes,
)

_LOCK = threading.Lock()
# Whether the engine has a tpu queue: None until the first backward after import asks.
HAS_QUEUE: list = [None]


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf):
        return create_empty_tensor((0,), torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return None


def _probe(original) -> bool:
    with _LOCK:
        if HAS_QUEUE[0] is None:
            with without_dispatch_modes(), torch.inference_mode(False), torch.enable_grad():
                leaf = torch.zeros((), requires_grad=True)
                root = _Probe.apply(leaf)
                try:
                    with torch.autograd.set_multithreading_enabled(True):
                        grad_of(original, root, leaf)
                    HAS_QUEUE[0] = True
                except RuntimeError as e:
                    if not lacks_device_queue(e):
                        raise
                    HAS_QUEUE[0] = False
        return HAS_QUEUE[0]


def _run_backward(original, *args, **kwargs):
    has_queue = HAS_QUEUE[0]
    if has_queue is None:
        has_queue = _probe(original)
    if has_queue:
        return original(*args, **kwargs)
    with torch.autograd.set_multithreading_enabled(False):
        return original(*args, **kwargs)


def register() -> None:
    install_backward_entry(_run_backward)
