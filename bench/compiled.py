"""Compiled mode: forward time of the same models under torchjax.jit,
torch.compile(backend="tpu"), pure JAX under jax.jit, torchax's compiled mode and native
torch CPU eager.

- MLP: 4 x (Linear(512, 512) + GELU) on a (64, 512) batch.
- tiny Llama: transformers LlamaConfig, 4 layers, hidden 256, 4 heads (2 KV heads),
  intermediate 512, vocab 1024; one forward over (1, 128) token ids. The pure-JAX
  version is the same network written with jax.numpy over the same weights (checked
  equal to the torch model before timing).

Each figure: median wall time of a forward blocking on its output, after warm-up
(compilation excluded). Ratios are against pure JAX (the target: torchjax.jit <= 1.05x).

Run:  python bench/compiled.py
"""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import fmt_us, header, median_us, ratio  # noqa: E402

RUNS = 100
ROPE_THETA = 10000.0


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).eval()


def llama():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=ROPE_THETA, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def inputs(name):
    if name == "mlp":
        return torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    return torch.randint(0, 1024, (1, 128), generator=torch.Generator().manual_seed(0))


# --- pure JAX versions of the two models over the torch weights ------------------------


def pure_mlp(weights):
    import jax

    @jax.jit
    def f(w, x):
        for i in range(4):
            x = jax.nn.gelu(x @ w[f"{2 * i}.weight"].T + w[f"{2 * i}.bias"], approximate=False)
        return x

    return f


def pure_llama(cfg):
    import jax
    import jax.numpy as jnp

    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd = dim // heads

    def rms(x, w):
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return w * (x * jax.lax.rsqrt(var + cfg.rms_norm_eps))

    def rotate(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + jnp.concatenate([-x2, x1], -1) * sin

    @jax.jit
    def f(w, ids):
        s = ids.shape[1]
        inv = 1.0 / (ROPE_THETA ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        freqs = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None]
        emb = jnp.concatenate([freqs, freqs], -1)
        cos, sin = jnp.cos(emb)[None, None], jnp.sin(emb)[None, None]
        mask = jnp.tril(jnp.ones((s, s), bool))
        h = w["model.embed_tokens.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = rms(h, w[p + "input_layernorm.weight"])
            q = (
                (x @ w[p + "self_attn.q_proj.weight"].T)
                .reshape(1, s, heads, hd)
                .transpose(0, 2, 1, 3)
            )
            k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(1, s, kv, hd).transpose(0, 2, 1, 3)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(1, s, kv, hd).transpose(0, 2, 1, 3)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = jnp.repeat(k, heads // kv, 1), jnp.repeat(v, heads // kv, 1)
            att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -jnp.inf)
            o = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(1, s, dim)
            h = h + o @ w[p + "self_attn.o_proj.weight"].T
            x = rms(h, w[p + "post_attention_layernorm.weight"])
            gate = jax.nn.silu(x @ w[p + "mlp.gate_proj.weight"].T)
            h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T

    return f


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def torchjax_results() -> dict:
    import jax

    import torchjax

    results = {}
    for name, make in (("mlp", mlp), ("llama", llama)):
        cpu = make()
        x = inputs(name)
        with torch.no_grad():
            results[(name, "torch CPU eager")] = median_us(lambda: cpu(x), runs=RUNS // 4)
            want = _logits(cpu(x))
        model = make().to("tpu")
        xt = x.to("tpu")
        weights = {k: v.jax() for k, v in model.state_dict().items()}
        pure = pure_mlp(weights) if name == "mlp" else pure_llama(cpu.config)
        ids = xt.jax() if name == "mlp" else xt.jax().astype(np.int32)
        got = pure(weights, ids)
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-3, atol=2e-3)
        results[(name, "pure JAX (jax.jit)")] = median_us(
            lambda: jax.block_until_ready(pure(weights, ids)), runs=RUNS
        )
        jitted = torchjax.jit(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tpu")
        with torch.no_grad():
            for label, fn in (("torchjax.jit", jitted), ('torch.compile(backend="tpu")', compiled)):
                out = _logits(fn(xt))
                np.testing.assert_allclose(out.cpu().numpy(), want.numpy(), rtol=2e-3, atol=2e-3)
                results[(name, label)] = median_us(
                    lambda fn=fn: jax.block_until_ready(_logits(fn(xt)).jax()), runs=RUNS
                )
    return results


def torchax_results(tx) -> dict:
    """Run in a child process by bench/_torchax.py: {"mlp": us, "llama": us}."""
    import jax

    out = {}
    env = tx.default_env()
    for name, make in (("mlp", mlp), ("llama", llama)):
        try:
            with env:
                model = make().to("jax")
                compiled = tx.compile(model)
                x = inputs(name).to("jax")
                with torch.no_grad():
                    out[name] = median_us(
                        lambda: jax.block_until_ready(_logits(compiled(x)).jax()), runs=RUNS
                    )
        except Exception as error:  # noqa: BLE001  (the table reports why)
            out[name] = f"n/a ({type(error).__name__}: {str(error)[:80]})"
    return out


def main() -> str:
    from bench import _torchax

    res = torchjax_results()
    tax = _torchax.measure("compiled")
    lines = [header("Compiled mode: forward time"), ""]
    lines.append("| model | engine | median | vs pure JAX |")
    lines.append("|---|---|---|---|")
    for name, title in (("mlp", "MLP 4x512, batch 64"), ("llama", "tiny Llama 4x256, seq 128")):
        base = res[(name, "pure JAX (jax.jit)")]
        rows = [(k[1], v) for k, v in res.items() if k[0] == name]
        rows.insert(3, ("torchax compiled (torchax.compile)", tax.get(name, tax.get("*", "n/a"))))
        for engine, us in rows:
            lines.append(f"| {title} | {engine} | {fmt_us(us)} | {ratio(us, base)} |")
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
