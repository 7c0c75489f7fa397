"""Backward on tpu whether or not a backward ran before ``import torchjax``, every node on
the calling thread (Note [Autograd device queues] in torchjax/device/_engine_queues.py).
Each order runs in a fresh interpreter: the engine sizes its queues once per process."""

import json

from tests._child import run_python

_CHECKS = """
import threading

result = {}
y = torch.ones(2, device="tpu", requires_grad=True)
threads = []
y.register_hook(lambda g: threads.append(threading.current_thread() is threading.main_thread()))
(y * 2).sum().backward()
result["tpu_grad"] = y.grad.cpu().tolist()
result["on_main_thread"] = threads
result["multithreading_after"] = torch.autograd.is_multithreading_enabled()
# A backward called from another Python thread runs its tpu nodes on that thread.
seen = []
def other():
    v = torch.ones(2, device="tpu", requires_grad=True)
    v.register_hook(lambda g: seen.append(threading.current_thread().name))
    (v * 4).sum().backward()
    seen.append(v.grad.cpu().tolist())
t = threading.Thread(target=other, name="caller")
t.start(); t.join()
result["other_thread"] = seen
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
    assert result["other_thread"] == ["caller", [4.0, 4.0]]
    # The caller's own multithreading setting is left as it was.
    assert result["multithreading_after"] is True
    assert result["through_tpu_grad"] == [3.0, 3.0]
    assert result["autograd_grad"] == [4.0, 4.0]
    assert result["cpu_grad"] == [5.0, 5.0]


def test_cpu_backward_before_import_then_tpu_backward_runs_on_the_calling_thread():
    result = _run(_CPU_BACKWARD_FIRST)
    _grads_as_cpu(result)
    assert result["on_main_thread"] == [True]


def test_import_first_runs_tpu_nodes_on_the_calling_thread_too():
    # Not on torch's tpu engine thread: a thread that runs Python could abort the
    # process at exit (Note [Autograd device queues]).
    result = _run(_IMPORT_FIRST)
    _grads_as_cpu(result)
    assert result["on_main_thread"] == [True]
