"""Small models shared by tests that compare eager, fused and captured runs."""

import torch
import transformers as tf

# A prompt for the tiny Llama: token ids within its vocabulary.
IDS = torch.tensor([[1, 17, 42, 99, 5, 6, 7, 8]])
# A 32-token prompt: SDPA's flash kernel takes sequence lengths that are multiples of 16.
KERNEL_IDS = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(0))


def tiny_llama(hidden_size: int = 32):
    """A seeded 2-layer Llama (hidden 32, 4/2 heads, vocab 128) in eval mode, on CPU.
    ``hidden_size=64`` gives head dim 16, the smallest the attention kernels take."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).eval()
