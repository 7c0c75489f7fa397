"""Small models shared by tests that compare eager, fused and captured runs."""

import torch
import transformers as tf

# A prompt for the tiny Llama: token ids within its vocabulary.
IDS = torch.tensor([[1, 17, 42, 99, 5, 6, 7, 8]])


def tiny_llama():
    """A seeded 2-layer Llama (hidden 32, 4/2 heads, vocab 128) in eval mode, on CPU."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).eval()
