"""Tensor-parallel loading of MoE (and Gemma 4) checkpoints in the Hub's layouts.

Run with the other cases in the 8-device subprocess (tests/sharding/_cases.py adds
``CASES`` to its own). Each tiny model is written the way its Hub checkpoints are: by
``save_pretrained``, which writes transformers' conversion mapping in reverse (one weight
per expert, Mixtral's ``block_sparse_moe.experts.N.w1``), Qwen3.5-MoE under its
multimodal parent's ``model.language_model.`` prefix; and, where that differs, as the
fused tensors the model holds. transformers' own ``from_pretrained`` on CPU reads each
checkpoint back to the reference logits first (so the layout is one it accepts); then
the tensor-parallel load on a 4-device "tp" mesh must give the same logits, with the
experts' weights split over "tp" as the model's plan says.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import jax
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import torchjax
import torchjax.sharding as ts
from tests.integrations import tiny_models as tiny
from torchjax.sharding import P

CASES: dict = {}

_COL3, _ROW3 = P(None, "tp", None), P(None, None, "tp")


def _mixtral():
    return tf.MixtralConfig(**tiny._DECODER, num_local_experts=4, num_experts_per_tok=2)


def _minimax_m2():
    return tf.MiniMaxM2Config(**tiny._DECODER, num_local_experts=4, num_experts_per_tok=2)


def _llama4():
    return tf.Llama4TextConfig(**tiny._DECODER, num_local_experts=4, intermediate_size_mlp=64)


def _gemma4():
    config = tiny._gemma4_moe()
    config.enable_moe_block = False
    return config


def _qwen3_5_moe():
    return tf.Qwen3_5MoeTextConfig(
        **{**tiny._DECODER, "head_dim": 16}, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip


def _qwen3_next_moe():
    config = tiny._qwen3_next()  # its first layer sparse: the Hub's Qwen3-Next are all MoE
    config.mlp_only_layers = [1]
    config.num_experts, config.num_experts_per_tok = 4, 2
    config.moe_intermediate_size = config.shared_expert_intermediate_size = 32
    return config


# name -> (config factory, {expert parameter: the spec its plan gives}, checkpoint prefix)
ARCHITECTURES = {
    "qwen3_moe": (tiny._qwen3_moe, {
        "model.layers.0.mlp.experts.gate_up_proj": _COL3,
        "model.layers.0.mlp.experts.down_proj": _ROW3}, None),
    "mixtral": (_mixtral, {
        "model.layers.0.mlp.experts.gate_up_proj": _COL3,
        "model.layers.0.mlp.experts.down_proj": _ROW3}, None),
    "minimax_m2": (_minimax_m2, {
        "model.layers.1.mlp.experts.gate_up_proj": _COL3,
        "model.layers.1.mlp.experts.down_proj": _ROW3}, None),
    "deepseek_v3": (tiny._deepseek_v3, {  # layer 0 is dense
        "model.layers.1.mlp.experts.gate_up_proj": _COL3,
        "model.layers.1.mlp.experts.down_proj": _ROW3}, None),
    "qwen3_5_moe": (_qwen3_5_moe, {
        "model.layers.1.mlp.experts.gate_up_proj": _COL3,
        "model.layers.1.mlp.experts.down_proj": _ROW3}, "model.language_model."),
    "qwen3_next_moe": (_qwen3_next_moe, {
        "model.layers.0.mlp.experts.gate_up_proj": _COL3,
        "model.layers.0.mlp.experts.down_proj": _ROW3,
        "model.layers.0.mlp.shared_expert.gate_proj.weight": P("tp", None)}, None),
    "gemma4_moe": (tiny._gemma4_moe, {
        "model.layers.0.experts.gate_up_proj": _COL3,
        "model.layers.0.experts.down_proj": _ROW3}, None),
    "gemma4": (_gemma4, {"model.layers.0.mlp.gate_proj.weight": P("tp", None)}, None),
    "llama4": (_llama4, {  # experts stored (E, in, out): packed_rowwise / colwise
        "model.layers.0.feed_forward.experts.gate_up_proj": _ROW3,
        "model.layers.0.feed_forward.experts.down_proj": _COL3}, None),
    "gpt_oss": (tiny._gpt_oss, {  # its plan shards only the embeddings and lm_head
        "model.layers.0.mlp.experts.gate_up_proj": P(),
        "model.embed_tokens.weight": P("tp", None)}, None),
}  # fmt: skip


def _close(a, b):
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=1e-4, rtol=1e-4)


def write_checkpoint(
    model, path: str, layout: str = "hub", prefix: str | None = None, max_shard_size=None
) -> list[str]:
    """``model`` written to ``path`` in ``layout`` ("hub": ``save_pretrained``, in files of
    at most ``max_shard_size`` with their index json when given, its keys under
    ``prefix`` when the Hub stores the text model inside a multimodal one; "fused": the
    model's own state dict in one file); returns the checkpoint's keys."""
    if layout == "hub":
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, **kwargs)
        if prefix is not None:
            _move_under(path, prefix)
    else:
        model.config.save_pretrained(path)
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_type"] == model.config.model_type
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert files, f"no safetensors written to {path}"
    return [k for n in files for k in load_file(os.path.join(path, n))]


def _move_under(path: str, prefix: str) -> None:
    """Every ``model.`` key of the checkpoint at ``path`` (its files and index) renamed to
    ``prefix`` + the rest."""

    def rename(key: str) -> str:
        return prefix + key.removeprefix("model.") if key.startswith("model.") else key

    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            file = os.path.join(path, name)
            tensors = {rename(k): v for k, v in load_file(file).items()}
            save_file(tensors, file, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        with open(index, "w", encoding="utf-8") as f:
            json.dump(data, f)


def _check(name: str, layout: str = "hub"):
    config, expert_specs, prefix = ARCHITECTURES[name]
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(config()).eval()
    prompt = torch.randint(3, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt).logits
    path = tempfile.mkdtemp(prefix=f"tj_tp_{name}_{layout}_")
    try:
        keys = write_checkpoint(ref, path, layout, prefix)
        with torch.no_grad():  # the layout is one transformers itself reads
            _close(tf.AutoModelForCausalLM.from_pretrained(path).eval()(prompt).logits, want)
        with torchjax.mesh((4,), ("tp",), devices=jax.devices()[:4]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = tf.AutoModelForCausalLM.from_pretrained(
                    path, device_map="tpu", tp_plan="auto"
                )
            unplaced = [str(w.message) for w in caught if "does not place" in str(w.message)]
            assert not unplaced, unplaced  # every style of the plan is placed
            with torch.no_grad():
                got = model(ts.shard(prompt, P())).logits
    finally:
        shutil.rmtree(path, ignore_errors=True)
    _close(got, want)
    specs = {}
    for param, spec in expert_specs.items():
        sharding = ts.sharding_of(model.get_parameter(param))
        assert sharding.spec == spec and len(sharding.device_set) == 4, (param, sharding)
        specs[param] = str(sharding.spec)
    per_expert = any(".experts.0." in k for k in keys)
    warned = sorted({str(w.message)[:120] for w in caught})
    return {"per_expert_checkpoint": per_expert, "specs": specs, "warnings": warned}


def _case(name: str, layout: str = "hub"):
    def run():
        return _check(name, layout)

    run.__name__ = f"tp_load_{name}_{layout}"
    CASES[run.__name__] = run


for _name in ARCHITECTURES:
    _case(_name)
for _name in ("qwen3_moe", "mixtral"):  # the fused tensors under the model's own names
    _case(_name, "fused")


def tp_load_saves_the_hub_layout_back():
    # The conversions that matched stay on the model, as from_pretrained keeps them:
    # save_pretrained of the tensor-parallel model writes the checkpoint it read.
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(_mixtral())
    src, dst = tempfile.mkdtemp(prefix="tj_tp_src_"), tempfile.mkdtemp(prefix="tj_tp_dst_")
    try:
        ref.save_pretrained(src)
        with torchjax.mesh((4,), ("tp",), devices=jax.devices()[:4]):
            model = tf.AutoModelForCausalLM.from_pretrained(src, device_map="tpu", tp_plan="auto")
            model.save_pretrained(dst)
        want = load_file(os.path.join(src, "model.safetensors"))
        got = load_file(os.path.join(dst, "model.safetensors"))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert torch.equal(got[key], value), key


CASES[tp_load_saves_the_hub_layout_back.__name__] = tp_load_saves_the_hub_layout_back
