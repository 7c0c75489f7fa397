"""The "tpu" device: registration, moving tensors and modules, no global side effects."""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tests._child import once_per_run
from torchjax.tensor import JaxTensor


def test_device_object():
    assert torch.device("tpu").type == "tpu"
    assert torch.device("tpu:0").index == 0
    assert torch._C._get_privateuse1_backend_name() == "tpu"


def test_to_tpu_variants():
    x = torch.arange(6.0).reshape(2, 3)
    for dev in ("tpu", "tpu:0", torch.device("tpu"), torch.device("tpu", 0)):
        y = x.to(dev)
        assert isinstance(y, JaxTensor)
        assert y.device == torch.device("tpu", 0)
        assert y.shape == x.shape and y.dtype == x.dtype
        torch.testing.assert_close(y.cpu(), x)
    assert isinstance(x.tpu(), JaxTensor)  # generated method, like x.cuda()
    assert x.to("tpu").is_tpu


def test_factories_on_tpu():
    z = torch.zeros(2, 3, device="tpu")
    assert isinstance(z, JaxTensor) and z.shape == (2, 3) and z.dtype == torch.float32
    assert torch.equal(z.cpu(), torch.zeros(2, 3))
    t = torch.tensor([1, 2], device="tpu")
    assert t.dtype == torch.int64 and t.tolist() == [1, 2]
    r = torch.randn(4, device="tpu")
    assert r.shape == (4,) and r.dtype == torch.float32 and r.device.type == "tpu"
    assert torch.arange(5, device="tpu").dtype == torch.int64
    f = torch.full((2,), 7, device="tpu")
    assert f.dtype == torch.int64 and f.tolist() == [7, 7]


def test_set_default_device():
    torch.set_default_device("tpu")
    try:
        a = torch.ones(3)
        b = torch.tensor([1.0, 2.0])
        assert a.device.type == "tpu" and b.device.type == "tpu"
        assert (a.sum()).item() == 3.0
    finally:
        # None removes the default-device mode; set_default_device("cpu") would leave a
        # mode injecting device="cpu" into every factory call (and break out= on tpu).
        torch.set_default_device(None)
    assert torch.ones(1).device.type == "cpu"


def test_module_to_keeps_tied_weights_and_buffers():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("persistent", torch.arange(3.0))
            self.register_buffer("scratch", torch.ones(2), persistent=False)

    m = Tied()
    w_cpu = m.embed.weight.detach().clone()
    m.to("tpu")
    assert m.head.weight is m.embed.weight
    assert isinstance(m.embed.weight, torch.nn.Parameter)
    assert m.embed.weight.requires_grad and m.embed.weight.is_leaf
    assert m.embed.weight.device.type == "tpu"
    assert m.persistent.device.type == "tpu" and m.scratch.device.type == "tpu"
    assert "scratch" not in m.state_dict()
    torch.testing.assert_close(m.embed.weight.cpu(), w_cpu)
    assert len(list(m.parameters())) == 1
    # One array behind both names: a write through one is seen by the other.
    with torch.no_grad():
        m.embed.weight.zero_()
    assert m.head.weight.abs().sum().item() == 0.0
    m.to("cpu")
    # Back on CPU the values are right, but torch's Module._apply makes a new Parameter
    # per module for a tpu -> CPU move (the CPU result is not a wrapper subclass, so it
    # cannot swap): ties must be re-made (model.tie_weights()). Known limitation.
    assert m.embed.weight.device.type == "cpu" and m.head.weight.device.type == "cpu"
    assert m.embed.weight.abs().sum().item() == 0.0


def test_worker_threads_move_tensors():
    # transformers 5 copies weights to the device from a thread pool.
    results, errors = [], []

    def work(i):
        try:
            t = torch.full((3,), float(i)).to("tpu")
            results.append((i, (t * 2).cpu()))
        except Exception as e:  # surfaced below with its thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, v in results:
        assert v.tolist() == [2.0 * i] * 3


def test_tensor_survives_contexts():
    with torch.no_grad():
        x = torch.ones(2, device="tpu")
    with torch.autocast("cpu"):
        pass
    assert (x + 1).tolist() == [2.0, 2.0]


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def fresh_import(request, tmp_path_factory) -> list:
    return once_per_run(request, tmp_path_factory, "fresh_import", _fresh_import)


def _fresh_import() -> list:
    # One child for the checks that need a process where torchjax is imported by the
    # user's code (importing torch and jax is most of a child's time): first that the
    # import changes nothing for CPU code, then the tensor type a "tpu" tensor gets.
    out = _run(
        """
        import torch
        fast = torch.backends.mha.get_fastpath_enabled()
        modes = torch._C._len_torch_function_stack()
        default = torch.get_default_device()
        import torchjax
        assert torch.backends.mha.get_fastpath_enabled() == fast
        assert torch._C._len_torch_function_stack() == modes
        assert torch.get_default_device() == default
        import jax
        assert not jax.config.jax_enable_x64  # the user's JAX keeps its defaults
        import jax.numpy as jnp
        assert jnp.arange(3).dtype == jnp.int32
        with torch.random.fork_rng():
            torch.rand(2)
        with torch.random.fork_rng(device_type="tpu"):
            torch.rand(2, device="tpu")
        f = torch.compile(lambda a: a * 2 + 1)  # inductor, as a CPU user runs it
        assert f(torch.ones(2)).tolist() == [3.0, 3.0]
        print("ok", flush=True)
        x = torch.ones(2).to("tpu")
        print("tensor:", type(x).__qualname__, x.device)
        """
    )
    return out.strip().splitlines()


def test_import_changes_nothing_for_cpu_code(fresh_import):
    assert "ok" in fresh_import


def test_dataloader_pin_memory_keeps_working():
    # Pinning for tpu is not possible: it says so (tests/device/test_pinned.py).
    ds = torch.utils.data.TensorDataset(torch.arange(4.0))
    with pytest.warns(UserWarning, match="unpinned copy"):
        batches = list(torch.utils.data.DataLoader(ds, batch_size=2, pin_memory=True))
    assert [b[0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]


def test_plain_rename_is_not_enough_but_ours_is(fresh_import):
    # Guards the private helper: if torch changes it, this fails here first.
    assert fresh_import[-1].split() == ["tensor:", "JaxTensor", "tpu:0"]


def test_torch_save_load_roundtrip(tmp_path):
    x = torch.tensor([1.5, -2.0], dtype=torch.float64).to("tpu")
    torch.save({"x": x}, tmp_path / "x.pt")
    y = torch.load(tmp_path / "x.pt")["x"]  # default weights_only=True accepts it
    assert y.device.type == "tpu" and y.dtype == torch.float64 and y.tolist() == [1.5, -2.0]
    m = torch.nn.Linear(3, 2).to("tpu")
    torch.save(m.state_dict(), tmp_path / "m.pt")
    sd = torch.load(tmp_path / "m.pt", map_location="cpu")
    assert sd["weight"].device.type == "cpu"
    torch.testing.assert_close(sd["weight"], m.weight.detach().cpu())
    fresh = torch.nn.Linear(3, 2).to("tpu")
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"))
    torch.testing.assert_close(fresh.bias.detach().cpu(), m.bias.detach().cpu())


def test_another_tpu_backend_is_named_at_import():
    # torch-tpu registers "tpu" (at `import torch`, through torch's backend autoloading):
    # torchjax's import then says so and what to do, instead of failing later, obscurely.
    from tests._child import run_python

    result = run_python(
        """
        import types, torch
        torch.utils.rename_privateuse1_backend("tpu")
        torch._register_device_module("tpu", types.ModuleType("torch_tpu"))
        import torchjax
        """
    )
    assert result.returncode != 0
    assert "RuntimeError: torchjax: the 'tpu' device is already registered by torch_tpu" in (
        result.stderr
    ), result.stderr[-2000:]
    assert "pip uninstall torch-tpu" in result.stderr
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in result.stderr
