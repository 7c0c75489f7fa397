"""torch.save / torch.load with tpu: every map_location form, weights_only both ways."""

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import torchjax  # noqa: F401
from torchjax.tensor import JaxTensor


def run_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter: a segfault fails the test, not the run."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def checkpoint():
    base = torch.arange(6.0).reshape(2, 3)
    return {
        "w": base,
        "tail": base.view(-1)[1:],  # shares w's storage, offset 1
        "t": base.t(),
        "big": torch.tensor([2**40 + 3, -7]),
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "p": torch.nn.Parameter(torch.ones(2)),
    }


MAP_LOCATIONS = {
    "str": "tpu",
    "str_index": "tpu:0",
    "device": torch.device("tpu", 0),
    "dict": {"cpu": "tpu"},
    "callable": lambda storage, location: storage.tpu(),
}


def test_cpu_checkpoint_onto_tpu_does_not_crash(tmp_path):
    path = tmp_path / "ck.pt"
    torch.save(checkpoint(), path)
    out = run_child(
        f"""
        import torch, torchjax
        for ml in ("tpu", "tpu:0", torch.device("tpu"), {{"cpu": "tpu"}},
                   lambda s, loc: s.tpu()):
            for wo in (True, False):
                d = torch.load({str(path)!r}, map_location=ml, weights_only=wo)
                print(sorted({{v.device.type for v in d.values()}}), d["tail"].tolist())
        """
    )
    lines = out.strip().split("\n")
    assert lines == ["['tpu'] [1.0, 2.0, 3.0, 4.0, 5.0]"] * 10


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("form", sorted(MAP_LOCATIONS))
def test_cpu_checkpoint_onto_tpu_matches_cpu(tmp_path, form, weights_only):
    path = tmp_path / "ck.pt"
    torch.save(checkpoint(), path)
    cpu = torch.load(path, weights_only=weights_only)
    tpu = torch.load(path, map_location=MAP_LOCATIONS[form], weights_only=weights_only)
    for key, want in cpu.items():
        got = tpu[key]
        assert isinstance(got, JaxTensor) and got.device == torch.device("tpu", 0), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert got.stride() == want.stride(), key
        assert got.storage_offset() == want.storage_offset(), key
        assert got.tolist() == want.tolist(), key
        assert isinstance(got, torch.nn.Parameter) == isinstance(want, torch.nn.Parameter), key
    # Tensors that shared a storage in the file still do, as on CPU.
    for d in (cpu, tpu):
        with torch.no_grad():
            d["w"][0, 1] = 100.0
    assert tpu["tail"].tolist() == cpu["tail"].tolist() == [100.0, 2.0, 3.0, 4.0, 5.0]
    assert tpu["t"][1, 0].item() == 100.0


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("form", sorted(MAP_LOCATIONS) + ["none", "cpu"])
def test_tpu_checkpoint_loads_back(tmp_path, form, weights_only):
    path = tmp_path / "ck.pt"
    torch.save(
        {
            k: v.to("tpu") if k != "p" else torch.nn.Parameter(v.to("tpu"))
            for k, v in checkpoint().items()
        },
        path,
    )
    location = {"none": None, "cpu": "cpu"}.get(form, MAP_LOCATIONS.get(form))
    if form == "callable":
        # torch's own limit for device tensors saved through a CPU copy (XLA's too):
        # _rebuild_device_tensor_from_cpu_tensor cannot ask a callable for a device.
        with pytest.raises(RuntimeError, match="Callable map_location not supported"):
            torch.load(path, map_location=location, weights_only=weights_only)
        return
    loaded = torch.load(path, map_location=location, weights_only=weights_only)
    device = "cpu" if form == "cpu" else "tpu"
    for key, want in checkpoint().items():
        got = loaded[key]
        assert got.device.type == device and got.dtype == want.dtype, key
        assert got.tolist() == want.tolist(), key
        assert isinstance(got, torch.nn.Parameter) == isinstance(want, torch.nn.Parameter), key


def test_module_state_dict_roundtrip_through_tpu(tmp_path):
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.save(cpu.state_dict(), tmp_path / "m.pt")
    tpu = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).to("tpu")
    tpu.load_state_dict(torch.load(tmp_path / "m.pt", map_location="tpu"))
    x = torch.randn(2, 3)
    torch.testing.assert_close(tpu(x.to("tpu")).cpu(), cpu(x))


def test_storage_tpu_method():
    s = torch.arange(4, dtype=torch.int32).untyped_storage()
    t = s.tpu()
    assert t.device == torch.device("tpu", 0) and t.nbytes() == 16
    x = torch.empty(0, dtype=torch.int32, device="tpu").set_(t, 1, (3,), (1,))
    assert x.tolist() == [1, 2, 3]
    typed = torch.TypedStorage(wrap_storage=s, dtype=torch.int32, _internal=True).tpu()
    assert typed.device.type == "tpu" and typed.dtype == torch.int32


def test_storage_constructor_on_tpu_does_not_crash():
    # torch's constructor would allocate through an allocator a Python backend lacks
    # (a segfault): run in a child so a crash fails the test.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import torch, torchjax
                s = torch.UntypedStorage(8, device="tpu")
                b = torch.UntypedStorage([1, 2, 3, 4], device=torch.device("tpu", 0))
                x = torch.empty(0, dtype=torch.uint8, device="tpu").set_(b, 1, (3,), (1,))
                t = torch.TypedStorage(3, dtype=torch.float32, device="tpu")
                print(s.device, s.nbytes(), x.tolist(), t.device, t.size())
                print(torch.UntypedStorage(2).device, list(torch.UntypedStorage([5, 6])))
                try:
                    torch.UntypedStorage(4, device="tpu:3")
                except RuntimeError as e:
                    print("refused", "invalid device ordinal tpu:3" in str(e))
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["tpu:0 8 [2, 3, 4] tpu:0 3", "cpu [5, 6]", "refused True"]


def test_load_onto_missing_device_index_raises(tmp_path):
    torch.save(torch.ones(1), tmp_path / "x.pt")
    with pytest.raises(RuntimeError, match="device 7 but torch.tpu.device_count"):
        torch.load(tmp_path / "x.pt", map_location="tpu:7")
    _assert_pickle_lands_on_tpu0()


def _assert_pickle_lands_on_tpu0():
    # A refused load leaves nothing behind: a later pickle of a tpu tensor comes back on
    # tpu:0, not where the failed load pointed (torch keeps a load's map_location in a
    # thread-local it clears only when the load succeeds; torch.load is wrapped).
    back = pickle.loads(pickle.dumps(torch.arange(3.0).to("tpu")))
    assert back.device == torch.device("tpu", 0) and back.tolist() == [0.0, 1.0, 2.0]


def test_failed_callable_load_leaves_pickle_working(tmp_path):
    torch.save(torch.ones(2).to("tpu"), tmp_path / "t.pt")
    with pytest.raises(RuntimeError, match="Callable map_location not supported"):
        torch.load(tmp_path / "t.pt", map_location=lambda s, loc: s)
    _assert_pickle_lands_on_tpu0()


def test_set_with_a_cpu_storage_raises():
    x = torch.empty(0, device="tpu")
    with pytest.raises(RuntimeError, match='device "tpu:0" to a storage on different device "cpu"'):
        x.set_(torch.ones(2).untyped_storage(), 0, (2,), (1,))
