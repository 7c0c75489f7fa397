"""torchjax/checkpoint/_writer.py: files written one tensor at a time are safetensors'
own bytes (Note [Streaming safetensors writes])."""

import pytest
import safetensors.torch
import torch

from torchjax import checkpoint as ck

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def _tensors():
    torch.manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(3, 5) * 50
        out[f"t{i}.{dtype}"] = (values > 0 if dtype == torch.bool else values).to(dtype)
    out["zero_d"] = torch.tensor(1.5)
    out["empty"] = torch.empty(0, 4)
    out['ünïcode "quoted"\n'] = torch.arange(7, dtype=torch.int64)
    out["a"] = torch.ones(2, dtype=torch.bfloat16)  # same dtype as others: name order
    return out


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {'k"\x01é': "v\n"}])
def test_bytes_equal_safetensors(tmp_path, metadata):
    cpu = _tensors()
    safetensors.torch.save_file(cpu, tmp_path / "cpu.safetensors", metadata=metadata)
    ck.save_file(cpu, tmp_path / "cpu_ours.safetensors", metadata=metadata)
    tpu = {k: v.to("tpu") for k, v in cpu.items()}
    ck.save_file(tpu, tmp_path / "tpu.safetensors", metadata=metadata)
    want = (tmp_path / "cpu.safetensors").read_bytes()
    assert (tmp_path / "cpu_ours.safetensors").read_bytes() == want
    assert (tmp_path / "tpu.safetensors").read_bytes() == want


def test_safetensors_save_file_of_tpu_tensors(tmp_path):
    # safetensors.torch.save_file streams tpu tensors (Note [safetensors' save_file of tpu
    # tensors]): its bytes, and its refusals.
    cpu = _tensors()
    safetensors.torch.save_file(cpu, tmp_path / "cpu.safetensors", metadata={"format": "pt"})
    tpu = {k: v.to("tpu") for k, v in cpu.items()}
    safetensors.torch.save_file(tpu, tmp_path / "tpu.safetensors", metadata={"format": "pt"})
    want = (tmp_path / "cpu.safetensors").read_bytes()
    assert (tmp_path / "tpu.safetensors").read_bytes() == want
    w = torch.ones(2, 2, device="tpu")
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file({"a": w, "b": w}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="non contiguous tensor: `t`"):
        safetensors.torch.save_file({"t": w.T}, tmp_path / "x.safetensors")
    # save_model keeps one of tied tensors, as on CPU.
    model = torch.nn.Linear(4, 4)
    model.extra = torch.nn.Linear(4, 4)
    model.extra.weight = model.weight
    safetensors.torch.save_model(model, tmp_path / "cpu_model.safetensors")
    safetensors.torch.save_model(model.to("tpu"), tmp_path / "tpu_model.safetensors")
    cpu_bytes = (tmp_path / "cpu_model.safetensors").read_bytes()
    assert (tmp_path / "tpu_model.safetensors").read_bytes() == cpu_bytes
