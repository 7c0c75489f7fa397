"""Tensor-parallel greedy generation of a tiny Llama, one process or several.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/tp_generate.py --tp 4

builds a tiny Llama (seeded, so every process builds the same one), saves it with
``save_pretrained``, loads it back with ``torchjax.sharding.load_pretrained`` sharded by the
model's own tensor-parallel plan (``plan="auto"``) over ``--tp`` devices, and prints the
greedy tokens and the sum of the first step's logits (``--tp 0``: the same on CPU
PyTorch, the reference every sharded run must print). Under ``jax.distributed`` (started by
examples/launch_multiprocess.py) the mesh spans every process's devices and each process
reads only its devices' blocks of the checkpoint; every process prints the same line.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def _distributed_init() -> None:
    # Set by examples/launch_multiprocess.py; must run before JAX starts its backend
    # (so before torchjax is imported).
    if "TORCHJAX_COORDINATOR" not in os.environ:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["TORCHJAX_COORDINATOR"],
        num_processes=int(os.environ["TORCHJAX_NUM_PROCESSES"]),
        process_id=int(os.environ["TORCHJAX_PROCESS_ID"]),
    )


_distributed_init()

import jax  # noqa: E402
import torch  # noqa: E402

import torchjax  # noqa: E402
import torchjax.sharding as ts  # noqa: E402


def build_checkpoint(path: str) -> torch.Tensor:
    """Save a seeded tiny Llama to ``path``; return the prompt (CPU int64 [1, 6])."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))


def _generate(model, ids, new_tokens: int) -> str:
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # .cpu() gathers; under jax.distributed every process takes part.
    tokens = out.sequences.cpu()[0].tolist()
    logits_sum = out.logits[0].float().cpu().sum().item()
    return f"tokens={tokens} logits_sum={logits_sum:.4f}"


def run(tp: int, new_tokens: int) -> str:
    """Greedy tokens of the tiny Llama sharded TP=``tp`` ways (``tp=0``: plain CPU
    PyTorch, the reference), as one line."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as path:
        prompt = build_checkpoint(path)
        if tp == 0:
            return _generate(AutoModelForCausalLM.from_pretrained(path).eval(), prompt, new_tokens)
        # The mesh spans all processes' devices; tp <= jax.device_count().
        with torchjax.mesh((tp,), ("tp",), devices=jax.devices()[:tp]):
            model = ts.load_pretrained(AutoModelForCausalLM, path, ts.TensorParallelConfig())
            ids = ts.shard(prompt, ts.P())  # replicated on the mesh, from every process
            return _generate(model, ids, new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tp", type=int, default=4, help="tensor-parallel devices (0: CPU PyTorch reference)"
    )
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args()
    line = run(args.tp, args.new_tokens)
    print(f"process {jax.process_index()}/{jax.process_count()}: {line}", flush=True)


if __name__ == "__main__":
    main()
