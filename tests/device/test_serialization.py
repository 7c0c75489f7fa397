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


def checkpoint(device="cpu"):
    base = torch.arange(6.0).reshape(2, 3).to(device)
    return {
        "w": base,
        "tail": base.view(-1)[1:],  # shares w's storage, offset 1
        "t": base.t(),
        "big": torch.tensor([2**40 + 3, -7]).to(device),
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16).to(device),
        "p": torch.nn.Parameter(torch.ones(2).to(device)),
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
    torch.save(checkpoint("tpu"), path)
    location = {"none": None, "cpu": "cpu"}.get(form, MAP_LOCATIONS.get(form))
    loaded = torch.load(path, map_location=location, weights_only=weights_only)
    device = "cpu" if form == "cpu" else "tpu"
    for key, want in checkpoint().items():
        got = loaded[key]
        assert got.device.type == device and got.dtype == want.dtype, key
        assert got.tolist() == want.tolist(), key
        assert got.stride() == want.stride(), key
        assert got.storage_offset() == want.storage_offset(), key
        assert isinstance(got, torch.nn.Parameter) == isinstance(want, torch.nn.Parameter), key
    with torch.no_grad():
        loaded["w"][0, 1] = 100.0  # "tail" and "t" shared w's storage when saved
    assert loaded["tail"].tolist() == [100.0, 2.0, 3.0, 4.0, 5.0]
    assert loaded["t"][1, 0].item() == 100.0


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


class _DeviceRebuilt:
    """Pickles as torch's rebuild of a storage-less device tensor from a CPU copy, the
    one rebuild that reads the load's map_location from torch's thread-local (files
    from torch's other Python backends, and earlier torchjax conjugate views, hold it)."""

    values = [1 + 2j, 3 - 1j]

    def __reduce__(self):
        cpu = torch.tensor(self.values)
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor, (cpu, cpu.dtype, "tpu", False))


def _assert_pickle_lands_on_tpu0():
    # A refused load leaves nothing behind: a later pickle of a tpu tensor comes back on
    # tpu:0, not where the failed load pointed (torch keeps a load's map_location in a
    # thread-local it clears only when the load succeeds; torch.load is wrapped).
    t = torch.arange(3.0).to("tpu")
    for obj, values in ((t, t.tolist()), (_DeviceRebuilt(), _DeviceRebuilt.values)):
        back = pickle.loads(pickle.dumps(obj))
        assert back.device == torch.device("tpu", 0) and back.tolist() == values


def test_failed_callable_load_leaves_pickle_working(tmp_path):
    torch.save(_DeviceRebuilt(), tmp_path / "t.pt")
    with pytest.raises(RuntimeError, match="Callable map_location not supported"):
        torch.load(tmp_path / "t.pt", map_location=lambda s, loc: s)
    _assert_pickle_lands_on_tpu0()


def test_set_with_a_cpu_storage_raises():
    x = torch.empty(0, device="tpu")
    with pytest.raises(RuntimeError, match='device "tpu:0" to a storage on different device "cpu"'):
        x.set_(torch.ones(2).untyped_storage(), 0, (2,), (1,))


FORMATS = {"zipfile": True, "legacy": False}


def _save(obj, path, fmt):
    torch.save(obj, path, _use_new_zipfile_serialization=FORMATS[fmt])


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("location", ["none", "cpu", "tpu", "callable"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tpu_checkpoint_in_either_format_matches_cpu(tmp_path, fmt, location, weights_only):
    # The legacy format reads storages' bytes after rebuilding every object; a tpu
    # tensor read them at its rebuild (uninitialised memory) and ignored map_location.
    cpu = checkpoint()
    _save(cpu, tmp_path / "cpu.pt", fmt)
    _save(checkpoint("tpu"), tmp_path / "tpu.pt", fmt)
    where = {"none": None, "callable": MAP_LOCATIONS["callable"]}.get(location, location)
    want = torch.load(tmp_path / "cpu.pt", weights_only=weights_only)
    got = torch.load(tmp_path / "tpu.pt", map_location=where, weights_only=weights_only)
    device = "cpu" if location == "cpu" else "tpu"
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].device.type == device, key
        assert got[key].dtype == want[key].dtype, key
        assert got[key].tolist() == want[key].tolist(), key
        assert got[key].stride() == want[key].stride(), key
        assert got[key].storage_offset() == want[key].storage_offset(), key
    for d in (want, got):
        with torch.no_grad():
            d["w"][1, 2] = -1.0
    assert got["tail"].tolist() == want["tail"].tolist() == [1.0, 2.0, 3.0, 4.0, -1.0]
    assert got["t"].tolist() == want["t"].tolist()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tied_state_dict_entries_share_after_load(tmp_path, fmt):
    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        m[1].weight = m[0].weight
        return m

    results = {}
    for device in ("cpu", "tpu"):
        _save(model().to(device).state_dict(), tmp_path / f"{device}.pt", fmt)
        sd = torch.load(tmp_path / f"{device}.pt")
        sd["0.weight"][0, 0] = 42.0
        results[device] = sd["1.weight"][0, 0].item()
    assert results == {"cpu": 42.0, "tpu": 42.0}


def test_a_saved_storage_is_written_once(tmp_path):
    # Views of one tensor and a tied module save one copy of its bytes, as on CPU.
    import zipfile

    base = torch.arange(12.0)
    objs = {"cpu": [base, base[2:5], base.view(3, 4).t()]}
    tpu = base.to("tpu")
    objs["tpu"] = [tpu, tpu[2:5], tpu.view(3, 4).t()]
    sizes = {}
    for device, obj in objs.items():
        torch.save(obj, tmp_path / f"{device}.pt")
        with zipfile.ZipFile(tmp_path / f"{device}.pt") as z:
            sizes[device] = sorted(i.file_size for i in z.infolist() if "/data/" in i.filename)
    assert sizes["tpu"] == sizes["cpu"] == [48]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dtype_views_in_one_checkpoint_refused_as_cpu(tmp_path, fmt):
    for device in ("cpu", "tpu"):
        x = torch.tensor([1.0, -2.0, 0.5]).to(device)
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            _save([x, x.view(torch.int32)], tmp_path / f"{device}.pt", fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_device_tensor_rebuilt_from_a_cpu_copy_loads(tmp_path, fmt):
    # What torchjax wrote before storages were saved, and torch writes for storage-less
    # backends: _rebuild_device_tensor_from_cpu_tensor over a CPU copy.
    class Saved:
        def __reduce_ex__(self, proto):
            cpu = torch.tensor([1.5, -2.0, 3.25])
            return (
                torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (cpu, torch.float32, "tpu:0", False),
            )

    _save(Saved(), tmp_path / "x.pt", fmt)
    for where, device in ((None, "tpu"), ("cpu", "cpu"), ("tpu", "tpu")):
        got = torch.load(tmp_path / "x.pt", map_location=where, weights_only=True)
        assert got.device.type == device and got.tolist() == [1.5, -2.0, 3.25], where


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
        torch.complex64,
        torch.float16,
        torch.int8,
        torch.uint8,
    ],
)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_dtype_round_trips(tmp_path, fmt, dtype):
    cpu = torch.tensor([[0, 1, 3], [7, 100, 2]], dtype=torch.int64).to(dtype)
    _save([cpu, cpu[1:]], tmp_path / "cpu.pt", fmt)
    _save([cpu.to("tpu"), cpu.to("tpu")[1:]], tmp_path / "x.pt", fmt)
    if fmt == "legacy" and dtype in (torch.uint16, torch.uint32, torch.uint64):
        # torch's legacy reader has no storage type for these dtypes, on CPU too.
        for path in ("cpu.pt", "x.pt"):
            with pytest.raises(AttributeError, match="has no attribute 'dtype'"):
                torch.load(tmp_path / path)
        return
    for where, device in ((None, "tpu"), ("cpu", "cpu")):
        full, tail = torch.load(tmp_path / "x.pt", map_location=where)
        assert full.device.type == tail.device.type == device
        assert full.dtype == dtype and torch.equal(full.cpu(), cpu)
        assert torch.equal(tail.cpu(), cpu[1:])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_saved_on_tpu_loads_without_torchjax(tmp_path, fmt):
    path = tmp_path / "x.pt"
    _save(checkpoint("tpu"), path, fmt)
    out = run_child(
        f"""
        import torch
        d = torch.load({str(path)!r}, map_location="cpu", weights_only=True)
        d["w"][0, 1] = 9.0
        print(d["tail"].tolist(), d["big"].tolist(), type(d["p"]).__name__)
        import sys
        print("torchjax" in sys.modules)
        """
    )
    assert out.split("\n")[:2] == [
        f"[9.0, 2.0, 3.0, 4.0, 5.0] {[2**40 + 3, -7]} Parameter",
        "False",
    ]


def test_set_to_a_whole_host_backed_storage_is_one_dimensional():
    x = torch.arange(6, dtype=torch.uint8).reshape(2, 3).to("tpu")
    storage = x.__reduce_ex__(2)[1][0]._untyped_storage  # x's bytes, host-backed
    whole = torch.empty(0, dtype=torch.uint8, device="tpu").set_(storage)
    assert whole.shape == (6,) and whole.tolist() == list(range(6))
    wide = torch.empty(0, dtype=torch.int16, device="tpu").set_(storage)
    want = torch.empty(0, dtype=torch.int16).set_(
        torch.arange(6, dtype=torch.uint8).untyped_storage()
    )
    assert wide.tolist() == want.tolist()


def test_storage_cpu_of_a_host_backed_storage():
    s = torch.arange(4, dtype=torch.int16).untyped_storage().tpu()
    assert s.cpu().device.type == "cpu" and list(s.cpu()) == list(
        torch.arange(4, dtype=torch.int16).untyped_storage()
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_empty_tensors_round_trip(tmp_path, fmt):
    # A 0-byte storage has no address: torch's legacy writer and reader copied it
    # through a plain tpu tensor that torchjax could not place (a RuntimeError).
    for t in (torch.empty(0), torch.zeros(0, 3, dtype=torch.int64)):
        _save(t.to("tpu"), tmp_path / "t.pt", fmt)
        back = torch.load(tmp_path / "t.pt")
        assert back.device.type == "tpu" and back.shape == t.shape and back.dtype == t.dtype
        assert pickle.loads(pickle.dumps(t.to("tpu"))).shape == t.shape
        _save(t, tmp_path / "c.pt", fmt)
        for where in ("tpu", torch.device("tpu", 0), {"cpu": "tpu"}, MAP_LOCATIONS["callable"]):
            back = torch.load(tmp_path / "c.pt", map_location=where)
            assert back.device.type == "tpu" and back.shape == t.shape, where


def _z(device):
    return torch.tensor([1 + 2j, -3 - 4j, 5 + 0j], dtype=torch.complex64).to(device)


# Each entry: what is saved in one torch.save, and a write to the loaded "z" (the plain
# tensor) whose effect on the views tells whether they share its storage.
MATH_BIT_SAVES = {
    "conj": lambda z: {"z": z, "c": z.conj(), "tail": [z.conj()[1:]]},
    "neg": lambda z: {"z": z.imag, "n": z.conj().imag, "re": z.real},
    "neg alone": lambda z: {"z": z.conj().imag},
}


@pytest.mark.parametrize("where", ["tpu", "cpu"])
@pytest.mark.parametrize("saved", sorted(MATH_BIT_SAVES))
def test_conjugate_and_negative_views_load_as_on_cpu(tmp_path, saved, where):
    # CPU saves a conj / neg view as its storage plus the bit: it loads as the same kind
    # of view, sharing memory with the other tensors of that storage in the file. A tpu
    # view was saved as a copy of its values: bits lost, sharing lost.
    def flat(obj):
        return [(k, v) for k, x in obj.items() for v in (x if isinstance(x, list) else [x])]

    results = {}
    for device in ("cpu", "tpu"):
        torch.save(MATH_BIT_SAVES[saved](_z(device)), tmp_path / f"{device}.pt")
        back = torch.load(tmp_path / f"{device}.pt", map_location=where)
        seen = [(k, t.device.type, t.is_conj(), t.is_neg(), t.tolist()) for k, t in flat(back)]
        back["z"].mul_(2)
        seen += [(k, t.cpu().tolist()) for k, t in flat(back)]
        for k, t in flat(back):
            if k != "z":
                t.add_(1)  # a write through a loaded view reaches the plain tensor
        seen.append(back["z"].cpu().tolist())
        results[device] = seen
    assert results["tpu"] == results["cpu"]
    assert any(r[2] or r[3] for r in results["tpu"] if len(r) == 5)
