"""torchjax/checkpoint/_load.py: safetensors files into tpu tensors (one device here;
per-device sharded reads in _sharded_check.py, run in one subprocess)."""

import json
import os
import subprocess
import sys

import jax
import pytest
import torch
from safetensors.torch import save_file

import torchjax
from torchjax import checkpoint as ck


def _tensors():
    torch.manual_seed(0)
    return {
        "f32": torch.randn(7, 5),
        "bf16": torch.randn(4, 6).bfloat16(),
        "f16": torch.randn(3, 2).half(),
        "i64": torch.tensor([2**31 + 5, -(2**40), 7]),
        "bool": torch.rand(4, 3) > 0.5,
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(1.25),
        "empty": torch.zeros(0, 3),
    }


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:  # no equality kernel for float8 on CPU
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_load_file_round_trip_every_dtype(tmp_path):
    ref = _tensors()
    save_file(ref, tmp_path / "a.safetensors")
    out = ck.load_file(tmp_path / "a.safetensors")
    assert set(out) == set(ref)
    for name, t in out.items():
        assert t.device.type == "tpu" and torchjax.to_jax(t).dtype.itemsize == t.element_size()
        assert _same(t.cpu(), ref[name]), name
    # Written back by torchjax: the very bytes safetensors.torch writes for the CPU values.
    ck.save_file(out, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_dtype_casts_floating_tensors_only(tmp_path):
    ref = _tensors()
    save_file(ref, tmp_path / "a.safetensors")
    out = ck.load_file(
        tmp_path / "a.safetensors", dtype=torch.bfloat16, keys=["f32", "i64", "bool"]
    )
    assert list(out) == ["f32", "i64", "bool"]
    assert _same(out["f32"].cpu(), ref["f32"].bfloat16())  # torch's rounding
    assert _same(out["i64"].cpu(), ref["i64"]) and _same(out["bool"].cpu(), ref["bool"])
    with pytest.raises(TypeError, match="must be a floating dtype"):
        ck.load_file(tmp_path / "a.safetensors", dtype=torch.int32)


def test_hf_sharded_index_and_device(tmp_path):
    ref = _tensors()
    save_file({k: ref[k] for k in ("f32", "bf16")}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: ref[k] for k in ("i64",)}, tmp_path / "model-00002-of-00002.safetensors")
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    weight_map = {"f32": first, "bf16": first, "i64": second}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert ck.read_index(tmp_path) == {
        k: os.path.join(str(tmp_path), v) for k, v in weight_map.items()
    }
    out = ck.load(tmp_path, device="tpu:0")
    assert set(out) == set(weight_map)
    assert all(_same(out[k].cpu(), ref[k]) for k in out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        ck.load(tmp_path / "empty")
    with pytest.raises(ValueError, match="reads into tpu tensors"):
        ck.load_file(tmp_path / "model-00002-of-00002.safetensors", device="cpu")


def test_partition_spec_needs_a_mesh(tmp_path):
    save_file({"w": torch.ones(4, 4)}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="no mesh is active"):
        ck.load_file(tmp_path / "a.safetensors", sharding={"w": jax.sharding.PartitionSpec("x")})
    with pytest.raises(TypeError, match="sharding= takes"):
        ck.load_file(tmp_path / "a.safetensors", sharding=3)


def test_sharded_reads_on_eight_simulated_devices():
    # XLA_FLAGS must be set before jax starts: one subprocess runs every sharded check.
    script = os.path.join(os.path.dirname(__file__), "_sharded_check.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ALL SHARDED CHECKS PASSED" in result.stdout


@pytest.mark.parametrize("device", ["tpu", "tpu:0", torch.device("tpu", 0)], ids=str)
def test_safetensors_load_file_takes_device_tpu(tmp_path, device):
    # CUDA's spelling: safetensors' Rust reader refused "tpu" (Note [safetensors'
    # load_file onto tpu]); the result is the CPU load's, on tpu.
    import safetensors.torch as st

    path = tmp_path / "m.safetensors"
    tensors = {
        "z.weight": torch.randn(3, 4),
        "a.ids": torch.arange(5),
        "m.half": torch.randn(2, 2).bfloat16(),
    }
    st.save_file(tensors, path)
    want = st.load_file(path)
    got = st.load_file(path, device=device)
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].device == torch.device("tpu", 0)
        assert got[name].dtype == w.dtype and torch.equal(got[name].cpu(), w)
    with pytest.raises(Exception, match="device nonsense is invalid"):
        st.load_file(path, device="nonsense")  # safetensors' own error for the rest


def test_loaded_arrays_are_placed_as_tensors_made_on_tpu(tmp_path):
    # Note [Uncommitted arrays on tpu:0]: a loaded tensor and one made on tpu take the
    # same program; a loaded array committed to its device compiled each op again.
    save_file({"w": torch.randn(3, 4)}, tmp_path / "a.safetensors")
    w = ck.load_file(tmp_path / "a.safetensors")["w"]
    made = torch.ones(3, 4, device="tpu")
    assert torchjax.to_jax(w).committed == torchjax.to_jax(made).committed
    torch.atan2(made, made).cpu()
    before = torchjax.stats()["compiles"]
    got = torch.atan2(w, made)
    assert torchjax.stats()["compiles"] == before
    torch.testing.assert_close(got.cpu(), torch.atan2(w.cpu(), made.cpu()))
