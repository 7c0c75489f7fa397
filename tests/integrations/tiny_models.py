"""Tiny transformers models from configs: seeded random weights, saved with save_pretrained.

No hub is reachable; each architecture is built from its config class (hidden 32, 2
layers, vocab 128), its matrices scaled up so greedy decoding is decisive (random init
gives near-ties that float rounding could flip), and written to a directory that
``from_pretrained`` then reads.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen3():
    return tf.Qwen3Config(**_DECODER)


def _qwen3_moe():
    return tf.Qwen3MoeConfig(
        **_DECODER, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    )


def _gpt2():
    return tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _gemma3():
    # One sliding-window layer (window 4 < prompt length) and one global layer.
    return tf.Gemma3TextConfig(
        **_DECODER, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )


def _t5():
    return tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip


def _qwen3_5():
    # Hybrid: one gated-delta-net linear-attention layer and one full-attention layer,
    # interleaved multimodal rope.
    return tf.Qwen3_5TextConfig(
        **{**_DECODER, "head_dim": 16},
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        },
    )  # fmt: skip


def _gemma4_moe():
    # Sliding and global layers, per-layer inputs, a MoE block beside the MLP, K = V.
    return tf.Gemma4TextConfig(
        **_DECODER, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        global_head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        attention_k_eq_v=True, num_global_key_value_heads=1,
    )  # fmt: skip


def _deepseek_v3():
    # Multi-head latent attention and grouped top-k routing (one dense layer first).
    config = {k: v for k, v in _DECODER.items() if k != "head_dim"}
    return tf.DeepseekV3Config(
        **{**config, "num_key_value_heads": 4},
        moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
    )  # fmt: skip


def _gpt_oss():
    # Attention sinks, a sliding layer, MoE with clamped SwiGLU experts.
    return tf.GptOssConfig(
        **{**_DECODER, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip


def _t5gemma():
    # Encoder-decoder of Gemma 2 stacks: sliding and global layers, soft-capping.
    def module(**kw):
        return tf.T5GemmaModuleConfig(
            **{k: v for k, v in _DECODER.items() if k != "bos_token_id"}, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], **kw,
        )  # fmt: skip

    return tf.T5GemmaConfig(
        encoder=module(), decoder=module(is_decoder=True), vocab_size=VOCAB,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip


def _qwen3_next():
    # Gated delta-net (linear attention) and gated full attention. Dense MLPs in both
    # layers: a bfloat16 MoE router ties experts often, and tpu breaks ties unlike CPU
    # (docs/numerics.md, topk ties), which moves a token's logits by a whole expert.
    return tf.Qwen3NextConfig(
        **{**_DECODER, "head_dim": 16}, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip


# Not in ARCHITECTURES (each of those runs every architecture test): used where named.
T5GEMMA = (tf.AutoModelForSeq2SeqLM, _t5gemma, "eager")
QWEN3_NEXT = (tf.AutoModelForCausalLM, _qwen3_next, "sdpa")

# name -> (Auto class, config factory, attn_implementation)
ARCHITECTURES = {
    "qwen3": (tf.AutoModelForCausalLM, _qwen3, "sdpa"),
    "qwen3_moe": (tf.AutoModelForCausalLM, _qwen3_moe, "sdpa"),
    "gpt2": (tf.AutoModelForCausalLM, _gpt2, "eager"),
    "gemma3": (tf.AutoModelForCausalLM, _gemma3, "eager"),
    "t5": (tf.AutoModelForSeq2SeqLM, _t5, "sdpa"),
    "qwen3_5": (tf.AutoModelForCausalLM, _qwen3_5, "sdpa"),
    "gemma4_moe": (tf.AutoModelForCausalLM, _gemma4_moe, "sdpa"),
    "deepseek_v3": (tf.AutoModelForCausalLM, _deepseek_v3, "sdpa"),
    "gpt_oss": (tf.AutoModelForCausalLM, _gpt_oss, "eager"),
}


def generate(model, batch: dict, **kwargs) -> torch.Tensor:
    """``model.generate(**batch, **kwargs)`` without grad, the batch moved to a tpu model's
    device first; the tokens on CPU."""
    if model.device.type == "tpu":
        batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        return model.generate(**batch, **kwargs).cpu()


def save_tiny(name: str, path: str, seed: int = 0, architectures=None) -> None:
    """Build architecture ``name`` of ``architectures`` (default ``ARCHITECTURES``) with
    seeded weights and ``save_pretrained`` it."""
    auto, config, _ = (architectures or ARCHITECTURES)[name]
    torch.manual_seed(seed)
    model = auto.from_config(config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path)
