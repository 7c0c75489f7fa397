"""flax NNX and PyTorch modules inside each other.

1. ``FlaxModule``: an ``nnx.Linear`` block inside a PyTorch model. Its kernel and bias
   are torch Parameters on "tpu" (``model.parameters()`` lists them) and a torch AdamW
   trains them along with the torch layers.
2. ``TorchModule``: a PyTorch encoder inside a flax NNX model, trained with
   ``nnx.Optimizer`` + optax under ``nnx.jit``.

Run:  python examples/flax_interop.py      (exits 0 when both losses go down)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

from torchjax.interop import FlaxModule, TorchModule


class TorchWithFlaxBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 16)
        self.block = FlaxModule(nnx.Linear(16, 16, rngs=nnx.Rngs(0)))  # a flax layer
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.block(torch.relu(self.inp(x)))))


def flax_inside_torch() -> list[float]:
    torch.manual_seed(0)
    model = TorchWithFlaxBlock().to("tpu")
    print("torch parameters:", [n for n, _ in model.named_parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 4, device="tpu")
    y = x.sum(-1, keepdim=True).sin()
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # reaches the flax kernel through jax.vjp
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class FlaxWithTorchEncoder(nnx.Module):
    def __init__(self, encoder: torch.nn.Module):
        self.encoder = TorchModule(encoder)  # a torch module, as an NNX module
        self.head = nnx.Linear(16, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.head(jnp.tanh(self.encoder(x)))


def torch_inside_flax() -> list[float]:
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU()).to("tpu")
    model = FlaxWithTorchEncoder(encoder)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 4)), jnp.float32)
    y = jnp.sin(x.sum(-1, keepdims=True))

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(30)]


def main() -> int:
    a = flax_inside_torch()
    print(f"flax block in a torch model, torch AdamW: loss {a[0]:.4f} -> {a[-1]:.4f}")
    b = torch_inside_flax()
    print(f"torch encoder in a flax model, optax AdamW: loss {b[0]:.4f} -> {b[-1]:.4f}")
    ok = a[-1] < a[0] and b[-1] < b[0]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
