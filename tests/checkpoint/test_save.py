"""torchjax/checkpoint/_save.py: tpu tensors to safetensors files, shared storage handled
as safetensors.torch does, tied parameters kept tied by load_model."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as torch_load_file

from torchjax import checkpoint as ck


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as lm_head / embed_tokens
        self.register_buffer("steps", torch.tensor([2**40]))

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def test_save_file_views_and_refusing_shared_storage(tmp_path):
    base = torch.arange(12.0).reshape(3, 4).to("tpu")
    # A view's elements are written (safetensors.torch refuses non-contiguous tensors).
    ck.save_file({"t": base.T}, tmp_path / "t.safetensors")
    ck.save_file({"row": base[1]}, tmp_path / "row.safetensors")
    assert torch.equal(torch_load_file(tmp_path / "t.safetensors")["t"], base.cpu().T)
    assert torch.equal(torch_load_file(tmp_path / "row.safetensors")["row"], base.cpu()[1])
    w = torch.ones(2, 2, device="tpu")
    with pytest.raises(RuntimeError, match=r"share memory.*save_model"):
        ck.save_file({"a": w, "b": w}, tmp_path / "shared.safetensors")
    with pytest.raises(RuntimeError, match="share memory"):
        ck.save_file({"t": base.T, "row": base[1]}, tmp_path / "overlap.safetensors")
    with pytest.raises(TypeError, match="'x' is a list"):
        ck.save_file({"x": [1]}, tmp_path / "bad.safetensors")


def test_save_model_and_load_model_keep_ties(tmp_path):
    torch.manual_seed(0)
    cpu = Tied()
    tpu = Tied()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    path = tmp_path / "tied.safetensors"
    ck.save_model(tpu, path, metadata={"format": "pt"})
    with safe_open(path, "pt") as f:
        assert "head.weight" not in f.keys() and "embed.weight" in f.keys()
        assert f.metadata() == {"format": "pt", "head.weight": "embed.weight"}
    fresh = Tied().to("tpu")  # other random weights
    head_param = fresh.head.weight
    missing, unexpected = ck.load_model(fresh, path)
    assert missing == [] and unexpected == []
    assert fresh.head.weight is fresh.embed.weight is head_param  # same Parameter object
    assert fresh.steps.cpu().item() == 2**40
    ids = torch.tensor([[1, 5, 15]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids.to("tpu")).cpu(), cpu(ids), rtol=1e-5, atol=1e-5)
    # Into a CPU-built model: parameters move to tpu and stay tied.
    fresh_cpu = Tied()
    ck.load_model(fresh_cpu, path)
    assert fresh_cpu.head.weight is fresh_cpu.embed.weight
    assert fresh_cpu.embed.weight.device.type == "tpu"
    with pytest.raises(RuntimeError, match="missing keys"):
        ck.load_model(torch.nn.Linear(8, 8), path)


def test_load_model_skips_non_persistent_buffers(tmp_path):
    # state_dict() leaves them out (HF's rotary inv_freq), so save_model does too.
    model = torch.nn.Linear(3, 2)
    model.register_buffer("scale", torch.arange(3.0), persistent=False)
    model.to("tpu")
    ck.save_model(model, tmp_path / "m.safetensors")
    fresh = torch.nn.Linear(3, 2)
    fresh.register_buffer("scale", torch.zeros(3), persistent=False)
    fresh.to("tpu")
    assert ck.load_model(fresh, tmp_path / "m.safetensors") == ([], [])
    assert torch.equal(fresh.weight.cpu(), model.weight.cpu())
    assert torch.equal(fresh.scale.cpu(), torch.zeros(3))  # not in the file: untouched
