"""pin_memory() with "tpu" as torch's accelerator (Note [Pinned memory with a tpu
accelerator]): torch's own kernel for any other target, a warning and an unpinned copy
for tpu, never a silent change."""

import subprocess
import sys
import textwrap

import pytest
import torch

from torchjax.device import _pinned


def _torch_alone(code: str) -> str:
    """stdout of ``code`` in a fresh interpreter that never imports torchjax."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _error_without_torchjax(call: str) -> str:
    return _torch_alone(
        f"""
        import warnings
        import torch
        warnings.simplefilter("ignore")
        try:
            {call}
        except Exception as e:
            print(type(e).__name__ + ": " + str(e).splitlines()[0])
        """
    )


def _error(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value).__name__ + ": " + str(info.value).splitlines()[0]


def test_pinning_for_tpu_warns_and_copies():
    x = torch.arange(6.0).view(2, 3).t()
    with pytest.warns(UserWarning, match=r"pin_memory\(\).*'tpu'.*unpinned copy"):
        y = x.pin_memory()
    assert torch.equal(y, x) and y.stride() == x.stride()
    assert not y.is_pinned()
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.filterwarnings("ignore:The argument 'device'")
def test_explicit_device_runs_torchs_kernel():
    # Without torchjax, torch raises for a CPU target; so does the tpu-aware kernel.
    want = _error_without_torchjax("torch.ones(3).pin_memory(device='cpu')")
    assert want.startswith("RuntimeError")
    assert _error(lambda: torch.ones(3).pin_memory(device="cpu")) == want


@pytest.mark.filterwarnings("ignore:The argument 'device'")
def test_another_accelerator_gets_torchs_kernel(monkeypatch):
    # On a CUDA host torch pins with CUDA whether or not torchjax is imported; here (no
    # CUDA library) torch's CUDA error must come through unchanged, not a tpu copy.
    monkeypatch.setattr(_pinned, "_host_accelerator", lambda: torch.device("cuda"))
    want = _error_without_torchjax("torch.ones(3).pin_memory(device='cuda')")
    assert _error(lambda: torch.ones(3).pin_memory()) == want


def test_host_accelerator_sees_none_here():
    assert _pinned._host_accelerator() is None
