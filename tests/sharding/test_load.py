"""load_pretrained with a TensorParallelConfig (torchjax/sharding/_load.py): tiny Llama,
Qwen3 and Gemma 3 (buffers __init__ computes), TP=4 on 8 simulated devices, logits and
greedy tokens equal CPU PyTorch's, parameter bytes per device 1/TP for sharded weights."""


def test_tp_llama_load_logits_generate(check):
    check("tp_llama_load_logits_generate")


def test_tp_qwen3_load_logits_generate(check):
    check("tp_qwen3_load_logits_generate")


def test_tp_gemma3_computed_buffers_match_cpu(check):
    check("tp_gemma3_computed_buffers_match_cpu")
