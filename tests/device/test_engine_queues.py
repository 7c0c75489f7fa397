"""Backward on tpu whether or not a backward ran before ``import torchjax`` (Note
[Autograd device queues] in torchjax/device/_engine_queues.py). Each order runs in a
fresh interpreter: the engine sizes its queues once per process."""

import json

from tests._child import run_python

_CHECKS = """
import threading
from torchjax.device import _engine_queues

result = {"has_queue": _engine_queues.HAS_QUEUE[0]}
y = torch.ones(2, device="tpu", requires_grad=True)
threads = []
y.register_hook(lambda g: threads.append(threading.current_thread() is threading.main_thread()))
(y * 2).sum().backward()
result["tpu_grad"] = y.grad.cpu().tolist()
result["on_main_thread"] = threads
result["has_queue"] = _engine_queues.HAS_QUEUE[0]
# A CPU root over tpu nodes, autograd.grad, and a CPU backward afterwards.
z = torch.ones(2, requires_grad=True)
(z.to("tpu") * 3).sum().cpu().backward()
result["through_tpu_grad"] = z.grad.tolist()
w = torch.full((2,), 2.0, device="tpu", requires_grad=True)
result["autograd_grad"] = torch.autograd.grad((w * w).sum(), w)[0].cpu().tolist()
c = torch.ones(2, requires_grad=True)
(c * 5).sum().backward()
result["cpu_grad"] = c.grad.tolist()
print(json.dumps(result))
"""

_CPU_BACKWARD_FIRST = """
import json
import torch
x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()
import torchjax
"""

_IMPORT_FIRST = """
import json
import torch
import torchjax
x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()
"""


def _run(prelude):
    out = run_python(prelude + _CHECKS, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _grads_as_cpu(result):
    assert result["tpu_grad"] == [2.0, 2.0]
    assert result["through_tpu_grad"] == [3.0, 3.0]
    assert result["autograd_grad"] == [4.0, 4.0]
    assert result["cpu_grad"] == [5.0, 5.0]


def test_cpu_backward_before_import_then_tpu_backward_runs_on_the_calling_thread():
    result = _run(_CPU_BACKWARD_FIRST)
    _grads_as_cpu(result)
    # The engine has no tpu queue: tpu nodes run on the thread that called backward.
    assert result["has_queue"] is False
    assert result["on_main_thread"] == [True]


def test_import_first_keeps_the_engines_tpu_thread():
    result = _run(_IMPORT_FIRST)
    _grads_as_cpu(result)
    assert result["has_queue"] is True
    assert result["on_main_thread"] == [False]
