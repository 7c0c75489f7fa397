"""The tiny Llama written directly in JAX: the reference a torchjax run is measured against.

transformers' ``LlamaForCausalLM`` (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP) as pure functions of a parameter dict taken from the torch model's
``state_dict``, so both run the same weights:

- ``forward(params, cfg, ids)``: logits of a whole sequence (no cache), the model as
  torch runs a prompt; call it plain for op-by-op jax.numpy or under ``jax.jit``;
  ``causal_lm_loss`` of its logits is transformers' ``labels=ids`` loss, for training.
- ``greedy(params, cfg, ids, new_tokens)``: greedy decoding over a static KV cache, the
  whole loop one ``lax.fori_loop`` (run it under ``jax.jit``: the decode limit);
  ``greedy_step`` is one token of it, for a jitted step called from a Python loop.

Only the configuration the bench models use is covered: no rope scaling, no attention or
MLP biases, no sliding window. ``check()`` compares with transformers on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    tied: bool

    @classmethod
    def of(cls, hf) -> Config:
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return cls(
            layers=hf.num_hidden_layers,
            heads=hf.num_attention_heads,
            kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            eps=hf.rms_norm_eps,
            theta=float(theta),
            tied=bool(hf.tie_word_embeddings),
        )


def params_of(model, dtype=None) -> dict:
    """The torch model's weights as jax arrays, keyed by their state_dict names."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        arr = jnp.asarray(t.float().numpy())
        out[name] = arr.astype(dtype or jnp.dtype(str(t.dtype).removeprefix("torch.")))
    return out


def _rms_norm(x, w, eps):
    # transformers' LlamaRMSNorm: statistics in float32, weight applied in the input dtype.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _rope(cfg: Config, positions, dtype):
    """cos, sin of (B, 1, S, head_dim) for rotary positions (B, S)."""
    inv = 1.0 / cfg.theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim)
    freqs = positions.astype(jnp.float32)[:, None, :, None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attention(cfg: Config, q, k, v, mask):
    """q (B, H, Sq, D), k/v (B, KV, Sk, D), mask (B or 1, 1, Sq, Sk) bool -> (B, Sq, H*D)."""
    groups = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (cfg.head_dim**-0.5)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bhkd->bhqd", probs, v)
    b, h, s, d = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def _layer(cfg: Config, p, i, x, cos, sin, mask, cache=None, pos=None):
    """One decoder layer on x (B, S, hidden). With ``cache`` (k, v of (B, KV, L, D)) the new
    keys and values are written at ``pos`` and attention reads the whole cache."""
    pre = f"model.layers.{i}."
    b, s, _ = x.shape
    h = _rms_norm(x, p[pre + "input_layernorm.weight"], cfg.eps)

    def proj(name, heads):
        w = p[pre + f"self_attn.{name}.weight"]
        return (h @ w.T).reshape(b, s, heads, cfg.head_dim).transpose(0, 2, 1, 3)

    q, k, v = proj("q_proj", cfg.heads), proj("k_proj", cfg.kv_heads), proj("v_proj", cfg.kv_heads)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if cache is not None:
        ck, cv = cache
        k = jax.lax.dynamic_update_slice_in_dim(ck, k, pos, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(cv, v, pos, axis=2)
        cache = (k, v)
    attn = _attention(cfg, q, k, v, mask) @ p[pre + "self_attn.o_proj.weight"].T
    x = x + attn
    h = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.eps)
    gate = h @ p[pre + "mlp.gate_proj.weight"].T
    up = h @ p[pre + "mlp.up_proj.weight"].T
    x = x + (jax.nn.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    return x, cache


def _logits(cfg: Config, p, x):
    x = _rms_norm(x, p["model.norm.weight"], cfg.eps)
    head = p["model.embed_tokens.weight"] if cfg.tied else p["lm_head.weight"]
    return x @ head.T


def forward(
    params: dict, cfg: Config, ids, *, remat: bool = False, logits_to_keep: int = 0
) -> jax.Array:
    """Logits (B, S, vocab) of ``ids`` (B, S), causal, no cache.

    ``remat``: each layer under ``jax.checkpoint`` (only its input is kept for the
    backward, the rest recomputed), as transformers' activation checkpointing does per
    decoder layer. ``logits_to_keep``: as transformers', logits of the last that many
    positions only (B, logits_to_keep, vocab); 0 keeps all."""
    x = params["model.embed_tokens.weight"][ids]
    b, s = ids.shape
    cos, sin = _rope(cfg, jnp.broadcast_to(jnp.arange(s), (b, s)), x.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]

    def layer(x, p, i):
        return _layer(cfg, p, i, x, cos, sin, mask)[0]

    if remat:
        layer = jax.checkpoint(layer, static_argnums=(2,))
    for i in range(cfg.layers):
        x = layer(x, params, i)
    return _logits(cfg, params, x[:, -logits_to_keep:])


def causal_lm_loss(logits, ids) -> jax.Array:
    """transformers' causal LM loss (``model(ids, labels=ids).loss``): cross entropy of
    each position's float32 logits against the next token, mean over B * (S - 1)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def _cached_step(params, cfg: Config, cache, x_ids, pos, positions, keep):
    """Logits of ``x_ids`` (B, S) written at cache slots pos.. with rotary ``positions``
    (B, S), attending to the slots up to their own that ``keep`` (B, cache length, bool:
    False for padding) keeps; the new cache."""
    x = params["model.embed_tokens.weight"][x_ids]
    s, length = x_ids.shape[1], cache[0][0].shape[2]
    slots = pos + jnp.arange(s)
    cos, sin = _rope(cfg, positions, x.dtype)
    causal = jnp.arange(length)[None, :] <= slots[:, None]
    mask = causal[None, None] & keep[:, None, None, :]
    new = []
    for i in range(cfg.layers):
        x, layer_cache = _layer(cfg, params, i, x, cos, sin, mask, cache[i], pos)
        new.append(layer_cache)
    return _logits(cfg, params, x), tuple(new)


def empty_cache(params, cfg: Config, batch: int, length: int):
    dtype = params["model.embed_tokens.weight"].dtype
    shape = (batch, cfg.kv_heads, length, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.layers))


def prefill(params, cfg: Config, ids, mask, new_tokens: int):
    """The prompt ``ids`` (B, S) with its attention ``mask`` (B, S; 0 for left padding)
    through a new static cache of S + new_tokens slots: (first token (B,), cache, next
    rotary positions (B,), keep (B, S + new_tokens)). Rotary positions count the
    unpadded tokens, as transformers' generate counts them."""
    b, s = ids.shape
    keep = jnp.concatenate([mask.astype(bool), jnp.ones((b, new_tokens), bool)], axis=1)
    positions = jnp.where(mask > 0, jnp.cumsum(mask, axis=1) - 1, 0)
    cache = empty_cache(params, cfg, b, s + new_tokens)
    logits, cache = _cached_step(params, cfg, cache, ids, 0, positions, keep)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(ids.dtype)
    return first, cache, positions[:, -1] + 1, keep


def greedy_step(params, cfg: Config, cache, token, slot, position, keep):
    """One decode step: (next token (B,), new cache) from ``token`` (B,) written at cache
    ``slot`` with rotary ``position`` (B,)."""
    logits, cache = _cached_step(params, cfg, cache, token[:, None], slot, position[:, None], keep)
    return jnp.argmax(logits[:, -1], axis=-1).astype(token.dtype), cache


def greedy(params, cfg: Config, ids, new_tokens: int, mask=None):
    """``new_tokens`` greedy tokens after ``ids`` (B, S) (``mask``: transformers'
    attention mask, default all ones): the prompt in one pass, then a ``lax.fori_loop``
    of decode steps over a static cache; returns (B, new_tokens)."""
    b, s = ids.shape
    mask = jnp.ones_like(ids) if mask is None else mask
    first, cache, position, keep = prefill(params, cfg, ids, mask, new_tokens)
    out = jnp.zeros((b, new_tokens), ids.dtype).at[:, 0].set(first)

    def body(i, carry):
        out, cache = carry
        token, cache = greedy_step(
            params, cfg, cache, out[:, i - 1], s + i - 1, position + i - 1, keep
        )
        return out.at[:, i].set(token), cache

    out, _ = jax.lax.fori_loop(1, new_tokens, body, (out, cache))
    return out


@functools.lru_cache(maxsize=None)
def jitted(cfg: Config, new_tokens: int):
    """``greedy`` under one ``jax.jit`` for this config and length: f(params, ids, mask)."""
    return jax.jit(lambda params, ids, mask: greedy(params, cfg, ids, new_tokens, mask))


def check(model, ids, new_tokens: int = 8) -> None:
    """Raises unless logits and greedy tokens match transformers' CPU run of ``model``."""
    import torch

    cfg, params = Config.of(model.config), params_of(model)
    with torch.no_grad():
        want = model(ids).logits.float().numpy()
        tokens = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[:, ids.shape[1] :].numpy()
    got = np.asarray(forward(params, cfg, jnp.asarray(ids.numpy())), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    jids = jnp.asarray(ids.numpy())
    gen = np.asarray(jitted(cfg, new_tokens)(params, jids, jnp.ones_like(jids)))
    np.testing.assert_array_equal(gen, tokens)
