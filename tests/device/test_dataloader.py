"""DataLoader workers start without JAX's fork warning (Note [DataLoader workers and
JAX's fork warning] in torchjax/device/_dataloader.py)."""

from tests._child import run_python

_CHILD = """
import warnings
warnings.simplefilter("always")  # every warning printed, none deduplicated
import torch
import torchjax
from torch.utils.data import DataLoader, TensorDataset

w = torch.ones(4, 4, device="tpu")  # JAX's backends are up: its fork hook is armed
data = torch.arange(32.0).reshape(16, 2)
loader = DataLoader(TensorDataset(data), batch_size=4, num_workers=2)
for epoch in range(2):
    seen = []
    for (batch,) in loader:
        seen.append(batch)
        out = (batch.to("tpu") @ w[:2, :2]).cpu()  # tpu work in the main process
        torch.testing.assert_close(out, batch @ torch.ones(2, 2))
    torch.testing.assert_close(torch.cat(seen), data)
print("patched epochs done", flush=True)
import sys
sys.stderr.write("--- uninstalled ---\\n")
torchjax.uninstall()
for (batch,) in loader:
    pass
"""


def test_two_worker_epochs_print_no_fork_warning():
    out = run_python(_CHILD, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "patched epochs done" in out.stdout
    patched, unpatched = out.stderr.split("--- uninstalled ---")
    assert "os.fork()" not in patched, patched[-2000:]
    # Without the patch, the same loader warns: the test can see the warning.
    assert "os.fork() was called" in unpatched
