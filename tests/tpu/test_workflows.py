"""Whole workflows on the chip against CPU: a diffusers pipeline with a compiled
transformer called twice, ten Trainer steps, a ``torch.compile`` train step, checkpoints
through ``torch.save`` and safetensors (and the host memory they leave held), and a
Kernels Hub kernel through ``kernelize``."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import safetensors.torch
import torch

import torchjax
from examples import hf_trainer
from tests.integrations import tiny_models


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_diffusers_pipeline_with_a_compiled_transformer_called_twice():
    from tests.integrations.tiny_pipelines import PIPELINES

    case = PIPELINES["flux"]
    pipe = case.build()
    pipe.set_progress_bar_config(disable=True)

    def call():
        # Note [CPU generators on tpu]: the noise is drawn on CPU, as on CPU.
        return case.call(pipe, torch.Generator().manual_seed(0))

    cpu = call()
    assert cpu and all(v.size and np.isfinite(v).all() and v.std() > 0 for v in cpu.values())
    pipe.to("tpu")
    pipe.transformer.compile(backend="tpu", fullgraph=True, dynamic=False)
    stats = []
    for _ in range(2):
        before = torchjax.compile.dynamo_stats()
        out = call()
        after = torchjax.compile.dynamo_stats()
        stats.append({k: after[k] - before[k] for k in before})
        assert out.keys() == cpu.keys()
        for name, want in cpu.items():
            np.testing.assert_allclose(out[name], want, rtol=0, atol=1e-4, err_msg=name)
    assert stats[0]["graphs"] == case.graphs
    assert stats[1] == {"graphs": 0, "traces": 0, "cache_hits": case.calls}


def test_ten_trainer_steps_match_cpu():
    cpu, cpu_eval, _ = hf_trainer.run("cpu", steps=10, evaluate=True)
    tpu, tpu_eval, trainer = hf_trainer.run("tpu", steps=10, evaluate=True)
    assert trainer.model.device.type == "tpu" and list(cpu) == list(tpu)
    # float32 losses: a few ulps of reduction order, carried forward by Adam.
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        torch.tensor(list(tpu.values())), torch.tensor(list(cpu.values())), **tol
    )
    torch.testing.assert_close(tpu_eval, cpu_eval, **tol)
    assert cpu[10] < cpu[1]


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_train_step_matches_cpu():
    import transformers as tf

    def build(device):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**tiny_models._DECODER)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=device == "tpu")
        return model, opt

    def step(model, opt, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, tiny_models.VOCAB, (2, 16), generator=g) for _ in range(3)]
    cpu_model, cpu_opt = build("cpu")
    want = [step(cpu_model, cpu_opt, b).item() for b in batches]
    model, opt = build("tpu")
    compiled = torch.compile(step, backend="tpu")
    got = [compiled(model, opt, b.to("tpu")).item() for b in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)


def test_checkpoints_round_trip(tmp_path):
    g = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(64, 32, generator=g),
        "h": torch.randn(128, generator=g).bfloat16(),
        "ids": torch.tensor([2**40 + 1, -5]),
        "t": torch.randn(8, 16, generator=g).t(),  # a transposed view
    }
    tpu = {k: v.to("tpu") for k, v in state.items()}
    torch.save(tpu, tmp_path / "ckpt.pt")
    for location in ("cpu", "tpu"):
        loaded = torch.load(tmp_path / "ckpt.pt", map_location=location, weights_only=True)
        for k, v in state.items():
            assert loaded[k].device.type == location and loaded[k].dtype == v.dtype
            assert torch.equal(loaded[k].cpu(), v), k
    contiguous = {k: v.contiguous() for k, v in tpu.items()}
    safetensors.torch.save_file(contiguous, tmp_path / "ckpt.safetensors")
    back = safetensors.torch.load_file(tmp_path / "ckpt.safetensors")
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def _resident_bytes() -> int:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back: what stays is held
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_host_reads_and_saves_leave_no_host_copy_of_the_weights(tmp_path):
    # A read off the chip copies, and jax keeps that copy on the array for as long as it
    # lives: a model saved on the chip kept its whole size in host memory (1.0x).
    weights = {f"w{i}": torch.randn(2048, 1024, device="tpu") for i in range(32)}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())  # 256 MiB
    jax.block_until_ready([torchjax.to_jax(t) for t in weights.values()])
    base = _resident_bytes()
    sums = [float(t.cpu().sum()) for t in weights.values()]
    torch.save(weights, tmp_path / "w.pt")
    safetensors.torch.save_file(weights, tmp_path / "w.safetensors")
    torchjax.checkpoint.save_file(weights, tmp_path / "w.ckpt.safetensors")
    kept = (_resident_bytes() - base) / nbytes
    assert kept < 0.25, f"{kept:.2f}x the weights stayed in host memory"
    back = safetensors.torch.load_file(tmp_path / "w.safetensors")
    assert [float(back[k].sum()) for k in weights] == sums


def test_a_kernels_hub_kernel_through_kernelize():
    import kernels
    import transformers as tf
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tests.integrations.test_kernels import REPO

    kernel = kernels.get_local_kernel(REPO)
    kernels.replace_kernel_forward_from_hub(LlamaRMSNorm, "RMSNorm")
    try:
        cfg = tf.LlamaConfig(**tiny_models._DECODER, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = model(input_ids=ids).logits
        model.to("tpu")
        mapping = {"RMSNorm": {"tpu": LocalLayerRepository(repo_path=REPO, layer_name="RMSNorm")}}
        with use_kernel_mapping(mapping):
            kernelize(model, device="tpu", mode=Mode.INFERENCE, use_fallback=False)
        before = kernel.CALLS["rms_norm"]
        with torch.no_grad():
            got = model(input_ids=ids.to("tpu")).logits
        assert kernel.CALLS["rms_norm"] > before  # the hub kernel ran
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    finally:
        del LlamaRMSNorm.kernel_layer_name, LlamaRMSNorm.kernel_condition
