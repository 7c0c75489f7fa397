"""JAX and PyTorch in one script.

1. A PyTorch model whose attention is a JAX function (``jax.nn.dot_product_attention``)
   called through ``torchjax.jax_function``: trained with torch.optim, gradients flowing
   through ``jax.vjp``; its output checked against the same model using torch's SDPA.
2. The same PyTorch model trained by a JAX loop: ``torchjax.functional`` makes it a pure
   function of a params pytree, optax's AdamW updates it under ``jax.jit``, and the
   trained arrays are written back into the torch model.

Run:  python examples/mix_jax_torch.py      (exits 0 when every check passes)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F

import torchjax


@torchjax.jax_function
def attention(q, k, v):
    """(batch, seq, heads, head_dim) in, same out: JAX's own fused attention."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, use_jax_attention=True):
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if use_jax_attention:
            o = attention(q, k, v)
        else:
            o = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
            ).transpose(1, 2)
        return self.head(x + self.proj(o.reshape(b, s, d)))


def batch(step, b=8, s=16, vocab=64):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (b, s + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def torch_training(model) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        ids, target = (t.to("tpu") for t in batch(step))
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        loss.backward()  # through jax.vjp for the attention
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def jax_training(model) -> list[float]:
    params, apply = torchjax.functional(model)
    tx = optax.adamw(3e-3)
    state = tx.init(params)

    @jax.jit
    def step(params, state, ids, target):
        def loss_fn(p):
            logits = apply(p, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(20):
        ids, target = batch(100 + i)
        params, state, loss = step(
            params, state, jnp.asarray(ids.numpy()), jnp.asarray(target.numpy())
        )
        losses.append(float(loss))
    with torch.no_grad():  # the trained arrays back into the torch model, no copies
        for name, p in model.named_parameters():
            p.copy_(torchjax.from_jax(params[name]))
    return losses


def main() -> int:
    torch.manual_seed(0)
    model = TinyTransformer().to("tpu")
    ids, _ = batch(0)
    with torch.no_grad():
        a = model(ids.to("tpu"))
        b = model(ids.to("tpu"), use_jax_attention=False)
    diff = (a - b).abs().max().item()
    print(f"JAX attention vs torch SDPA: max |diff| = {diff:.2e}")

    t_losses = torch_training(model)
    print(f"torch.optim loop (JAX attention inside): loss {t_losses[0]:.3f} -> {t_losses[-1]:.3f}")
    j_losses = jax_training(model)
    print(f"optax loop (torch model inside jax.jit):  loss {j_losses[0]:.3f} -> {j_losses[-1]:.3f}")
    with torch.no_grad():
        final = F.cross_entropy(
            model(batch(100 + 19)[0].to("tpu")).flatten(0, 1),
            batch(100 + 19)[1].to("tpu").flatten(),
        ).item()
    ok = (
        diff < 1e-5
        and t_losses[-1] < t_losses[0]
        and j_losses[-1] < j_losses[0]
        and np.isfinite(final)
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
