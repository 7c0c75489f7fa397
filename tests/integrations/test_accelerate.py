"""accelerate on a machine whose torch accelerator is "tpu": Accelerator() training and
checkpoints, and big-model loading with device_map="auto" and cpu/disk offload, = CPU."""

import pytest
import torch
import transformers as tf
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from torch.utils.data import DataLoader, TensorDataset

from tests.integrations import tiny_models

IDS = torch.tensor([[1, 5, 9, 17, 33, 60]])


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # PartialState is a process-wide singleton: each test builds its own.
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerator_device_is_tpu():
    assert PartialState().device == torch.device("tpu", 0)
    assert Accelerator().device == torch.device("tpu", 0)


def test_cpu_request_still_means_cpu():
    assert Accelerator(cpu=True).device == torch.device("cpu")


def _train(cpu: bool, directory):
    accelerator = Accelerator(cpu=cpu)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=4))
    losses = []
    for x, y in loader:
        assert x.device == accelerator.device
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(str(directory))
    saved = [p.detach().cpu().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(directory))
    loaded = [p.detach().cpu() for p in model.parameters()]
    return losses, saved, loaded, model


def test_prepare_backward_save_and_load_state_match_cpu(tmp_path):
    cpu_losses, cpu_saved, _, _ = _train(True, tmp_path / "cpu")
    AcceleratorState._reset_state(reset_partial_state=True)
    losses, saved, loaded, model = _train(False, tmp_path / "tpu")
    assert next(model.parameters()).device.type == "tpu"
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved, cpu_saved, rtol=1e-5, atol=1e-6)
    for a, b in zip(saved, loaded):
        assert torch.equal(a, b)


def test_save_and_load_state_keep_tied_weights(tmp_path):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied, as in a language model
    model = accelerator.prepare(model)
    weight = model[0].weight.detach().cpu().clone()
    accelerator.save_state(str(tmp_path))
    with torch.no_grad():
        model[0].weight.zero_()
    accelerator.load_state(str(tmp_path))
    assert model[1].weight is model[0].weight
    assert torch.equal(model[1].weight.detach().cpu(), weight)


def test_load_state_restores_the_tpu_rng(tmp_path):
    # Dropout on tpu draws from the tpu RNG: after load_state the next step must draw the
    # masks the step after save_state drew.
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5)))
    x = torch.ones(2, 4, device="tpu")
    model(x)
    accelerator.save_state(str(tmp_path))
    after_save = model(x).cpu()
    model(x)  # moves the RNG on
    accelerator.load_state(str(tmp_path))
    assert torch.equal(model(x).cpu(), after_save)
    states = torch.load(next(tmp_path.glob("random_states_*.pkl")), weights_only=False)
    assert len(states["torch_tpu_manual_seed"]) == torch.tpu.device_count()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    tiny_models.save_tiny("qwen3", path)
    return path, tf.AutoModelForCausalLM.from_pretrained(path)(IDS).logits


# f32 logits: XLA's matmul rounding, not ATen's.
TOL = dict(rtol=1e-5, atol=1e-5)


def test_device_map_auto_uses_tpu(qwen3):
    path, expected = qwen3
    model = tf.AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    assert model.device == torch.device("tpu", 0)
    torch.testing.assert_close(model(IDS.to("tpu")).logits.cpu(), expected, **TOL)


def test_device_map_auto_offloads_to_disk_past_max_memory(qwen3, tmp_path):
    path, expected = qwen3
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={0: "60KB", "cpu": "40KB"}, offload_folder=tmp_path
    )
    assert {0, "disk"} <= set(model.hf_device_map.values()), model.hf_device_map
    torch.testing.assert_close(model(IDS.to("tpu")).logits.cpu(), expected, **TOL)


def test_cpu_and_disk_offload_match_cpu(qwen3, tmp_path):
    # accelerate's hooks move the cpu and disk layers' weights to tpu for each forward.
    path, expected = qwen3
    device_map = {
        "model.embed_tokens": "tpu", "model.rotary_emb": "tpu", "model.layers.0": "tpu",
        "model.layers.1": "cpu", "model.norm": "disk", "lm_head": "disk",
    }  # fmt: skip
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, device_map=device_map, offload_folder=tmp_path
    )
    assert model.hf_device_map == device_map
    # Offloaded layers hold meta tensors between forwards; their weights live in the hooks.
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert model.lm_head.weight.device.type == "meta"
    for _ in range(2):  # the hooks put the weights back after each forward
        torch.testing.assert_close(model(IDS.to("tpu")).logits.cpu(), expected, **TOL)
