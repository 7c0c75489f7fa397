"""transformers.Trainer on "tpu": the same losses as the same run on CPU.

Tolerances: f32 losses differ from CPU's by float rounding only (XLA's matmul and
reduction order is not ATen's), a few ulps that Adam carries forward; bf16 autocast
rounds different intermediate values on each side, so its bound is wider.
"""

import os

import pytest
import torch

from examples import hf_trainer as runs

F32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=0, atol=2e-3)


def _assert_losses_close(cpu, tpu, **tol):
    assert list(cpu) == list(tpu), (cpu, tpu)
    torch.testing.assert_close(
        torch.tensor(list(tpu.values())), torch.tensor(list(cpu.values())), **tol
    )


def test_batches_follow_the_model_to_tpu():
    # The model was moved to tpu and the batches stayed on CPU (accelerate's device was
    # cpu): the first forward failed in aten::embedding.
    losses, _, trainer = runs.run("tpu", steps=2)
    assert trainer.accelerator.device == torch.device("tpu", 0)
    assert trainer.model.device.type == "tpu"
    assert len(losses) == 2


def test_causal_lm_20_steps_and_eval_match_cpu():
    cpu, cpu_eval, _ = runs.run("cpu", steps=20, evaluate=True)
    tpu, tpu_eval, _ = runs.run("tpu", steps=20, evaluate=True)
    _assert_losses_close(cpu, tpu, **F32)
    torch.testing.assert_close(tpu_eval, cpu_eval, **F32)
    assert cpu[20] < cpu[1]  # it trains


def test_classifier_bf16_matches_cpu():
    cpu, cpu_eval, _ = runs.run("cpu", "classifier", steps=4, evaluate=True, bf16=True)
    tpu, tpu_eval, trainer = runs.run("tpu", "classifier", steps=4, evaluate=True, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    _assert_losses_close(cpu, tpu, **BF16)
    torch.testing.assert_close(tpu_eval, cpu_eval, **BF16)


@pytest.mark.parametrize("task", ["causal_lm", "classifier"])
def test_gradient_accumulation_matches_cpu(task):
    cpu, _, _ = runs.run("cpu", task, steps=3, gradient_accumulation_steps=2)
    tpu, _, _ = runs.run("tpu", task, steps=3, gradient_accumulation_steps=2)
    _assert_losses_close(cpu, tpu, **F32)


def test_torch_compile_matches_cpu():
    # torch_compile=True compiles with torch.compile's default backend, which hands graphs
    # of tpu tensors to the "tpu" backend (Note [The default torch.compile backend on tpu]).
    # Dynamo's caches start empty, as in the other torch.compile tests: code objects an
    # earlier test compiled can recompile here with a float attribute made dynamic, a
    # graph calling .item() on it (a case the "tpu" backend refuses under its trace).
    torch._dynamo.reset()
    cpu, _, _ = runs.run("cpu", steps=3)
    tpu, _, trainer = runs.run("tpu", steps=3, torch_compile=True)
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    _assert_losses_close(cpu, tpu, **F32)


def test_torch_compile_backend_tpu_names_torchjaxs_backend():
    # accelerate checks the name against its DynamoBackend enum, which has no "tpu"
    # (ValueError before Note [accelerate's Dynamo backend names]); the Trainer's model is
    # then compiled with backend="tpu" and trains as on CPU.
    import accelerate

    torch._dynamo.reset()
    cpu, _, _ = runs.run("cpu", steps=3)
    tpu, _, trainer = runs.run("tpu", steps=3, torch_compile=True, torch_compile_backend="tpu")
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert trainer.accelerator.state.dynamo_plugin.to_kwargs()["backend"] == "tpu"
    _assert_losses_close(cpu, tpu, **F32)
    with pytest.raises(ValueError, match="'NOT_A_BACKEND' is not a valid DynamoBackend"):
        accelerate.utils.TorchDynamoPlugin(backend="not_a_backend")


def test_fp16_is_refused_by_accelerate():
    # accelerate allows fp16 (and its GradScaler) only on devices it names; bf16, which
    # needs no scaler, is the mixed precision for tpu.
    # (accelerate 1.15 and 1.16 word it differently)
    refused = r"fp16 mixed precision (requires a device in .*|is not supported on )'tpu'"
    with pytest.raises(ValueError, match=refused):
        runs.run("tpu", steps=1, fp16=True)


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    # Dropout draws from the tpu RNG: the resumed run gets the same masks only if the
    # checkpoint saved the tpu RNG state and resuming restored it.
    kw = dict(task="classifier", dropout=0.1, save_strategy="steps", save_steps=2)
    whole, _, _ = runs.run("tpu", steps=4, output_dir=str(tmp_path / "whole"), **kw)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    states = torch.load(checkpoint / "rng_state.pth", weights_only=False)
    assert len(states["tpu"]) == torch.tpu.device_count()
    resumed, _, _ = runs.run(
        "tpu", steps=4, output_dir=str(tmp_path / "resumed"), resume=str(checkpoint), **kw
    )
    # The resumed trainer's history starts with the checkpoint's steps 1 and 2.
    assert resumed == whole


def test_checkpoint_without_tpu_rng_state_still_loads(tmp_path):
    kw = dict(task="classifier", save_strategy="steps", save_steps=1)
    runs.run("tpu", steps=1, output_dir=str(tmp_path / "a"), **kw)
    path = tmp_path / "a" / "checkpoint-1" / "rng_state.pth"
    states = torch.load(path, weights_only=False)
    del states["tpu"]  # as written on a machine without tpu
    torch.save(states, path)
    resumed, _, _ = runs.run(
        "tpu", steps=2, output_dir=str(tmp_path / "b"), resume=str(path.parent), **kw
    )
    assert sorted(resumed) == [1, 2]
    assert os.path.isfile(tmp_path / "b" / "checkpoint-2" / "rng_state.pth")
