"""``torch.compile(backend="tpu")`` finds torchjax's backend with or without the package's
entry point (Note [Finding the "tpu" Dynamo backend])."""

import pytest

from tests._child import run_python

# The child sees no "tpu" entry point, as when the checkout is on PYTHONPATH uninstalled.
_HIDE_ENTRY_POINT = """
import importlib.metadata as md
_entry_points = md.entry_points
def entry_points(**kw):
    got = _entry_points(**kw)
    if kw.get("group") == "torch_dynamo_backends":
        return md.EntryPoints([e for e in got if e.name != "tpu"])
    return got
md.entry_points = entry_points
assert not md.entry_points(group="torch_dynamo_backends").select(name="tpu")
"""

_COMPILE = """
def f(x):
    return (x * 2).sin().sum(0)

x = torch.arange(6.0).reshape(2, 3)
got = torch.compile(f, backend="tpu")(x.to("tpu"))
assert got.device.type == "tpu", got.device
torch.testing.assert_close(got.cpu(), f(x))
from torch._dynamo.backends.registry import lookup_backend
from torchjax.compile._dynamo import backend
from torchjax.integrations import _dynamo_backend
assert lookup_backend("tpu") in (backend, _dynamo_backend.tpu)
assert "torch._dynamo backend 'tpu'" in [p.name for p in torchjax.patches()]
"""


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["torchjax-first", "dynamo-first"])
def test_backend_found_without_the_entry_point(dynamo_first):
    # Seen on a TPU VM, where the checkout is on PYTHONPATH: InvalidBackend: 'tpu'.
    first = "import torch._dynamo\n" if dynamo_first else ""
    code = (
        _HIDE_ENTRY_POINT
        + "import sys, torch\n"
        + first
        + "import torchjax\n"
        + ("" if dynamo_first else "assert 'torch._dynamo' not in sys.modules\n")
        + _COMPILE
        + """
torchjax.uninstall()
from torch._dynamo.exc import InvalidBackend
try:
    lookup_backend("tpu")
except InvalidBackend:
    print("ok")
"""
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_importing_the_backend_module_before_dynamo():
    # Importing torchjax.compile._dynamo imports Dynamo, which registers the backend while
    # that module is half made: the registration must not import it (ImportError).
    out = run_python(
        """
        import sys, torch, torchjax
        assert "torch._dynamo" not in sys.modules
        print(torchjax.compile.dynamo_stats())
        import torchjax.compile._dynamo
        x = torch.ones(3)
        got = torch.compile(lambda a: a * 2, backend="tpu")(x.to("tpu"))
        assert got.cpu().tolist() == [2.0, 2.0, 2.0]
        print("ok")
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_a_function_compiled_for_cpu_then_recompiled_for_tpu():
    # The backend's module must be imported before Dynamo traces tpu tensors (its
    # import installs Dynamo's skip rules for torchjax): with Dynamo imported by a CPU
    # compile first, the recompile for tpu failed inside Dynamo (InternalTorchDynamoError).
    out = run_python(
        _HIDE_ENTRY_POINT
        + """
import torch, torchjax

def f(a):
    return a + a.untyped_storage().nbytes()

want = torch.compile(f, backend="eager")(torch.zeros(4)[1:])
got = torch.compile(f, backend="tpu")(torch.zeros(4, device="tpu")[1:])
assert got.cpu().tolist() == want.tolist() == [16.0] * 3
print("ok")
"""
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_entry_point_and_registration_give_the_same_backend():
    # Installed: the registration comes first; after uninstall the entry point serves
    # torchjax.compile._dynamo.backend itself.
    out = run_python(
        "import sys, torch, torchjax\n"
        + _COMPILE
        + """
torchjax.uninstall()
assert lookup_backend("tpu") is backend  # loaded from the installed entry point
print("ok")
"""
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
