"""float32 accuracy on the chip, against float64 on CPU: where a kernel's error comes from.

The ``precision`` section of ``python -m bench.tpu``:

- ``attention``: a causal GQA SDPA (1, 8/2 heads, 1024, 128) in float32, forward and
  backward, three ways: CPU torch's float32 math, XLA:TPU's own attention (the math path,
  the flash switch off) and torchjax's flash kernel (the default). Each output's largest
  error from CPU torch's float64 result, as a share of that output's largest magnitude,
  and the kernel's distance from CPU float32 (what the kernel tests measure);
- ``exp``: float32 ``exp`` over [-30, 0] (the range of a softmax's shifted scores) inside
  a Mosaic kernel and in XLA:TPU, each against float64: the largest relative error, in
  float32 ulps (2**-23 = 1.19e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl

from torchjax import pallas as tp

_ULP = 2.0**-23


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return float(f"{((got.double().cpu() - want).abs().max() / scale).item():.3g}")


def attention() -> dict:
    b, hq, hkv, s, d = 1, 8, 2, 1024, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    ct = torch.randn(b, hq, s, d, generator=g)

    def run(device, dtype, flash=True):
        xs = [x.to(device, dtype, copy=True).requires_grad_() for x in (q, k, v)]
        with tp.use_flash_attention(flash):
            out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True)
            out.backward(ct.to(dtype).to(device))
        return [out.detach()] + [x.grad for x in xs]

    f64 = run("cpu", torch.float64)
    ways = {
        "cpu_f32": run("cpu", torch.float32),
        "xla_f32": run("tpu", torch.float32, flash=False),
        "kernel_f32": run("tpu", torch.float32, flash=True),
    }
    names = ("out", "dq", "dk", "dv")
    rows = {w: dict(zip(names, map(_rel, got, f64))) for w, got in ways.items()}
    cpu32 = [x.double() for x in ways["cpu_f32"]]
    rows["kernel_vs_cpu_f32"] = dict(zip(names, map(_rel, ways["kernel_f32"], cpu32)))
    rows["xla_vs_cpu_f32"] = dict(zip(names, map(_rel, ways["xla_f32"], cpu32)))
    return {"shape": [b, hq, hkv, s, d], "error_of_scale": rows}


def _exp_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])


def exp() -> dict:
    x64 = np.linspace(-30.0, 0.0, 1024 * 128).reshape(1024, 128)
    x32 = x64.astype(np.float32)
    want = np.exp(x32.astype(np.float64))
    with jax.enable_x64(False):
        xj = jnp.asarray(x32)
        mosaic = pl.pallas_call(
            _exp_kernel,
            out_shape=jax.ShapeDtypeStruct(xj.shape, xj.dtype),
            interpret=jax.default_backend() != "tpu",  # off the chip: checks the script
        )
        got = {"mosaic": np.asarray(jax.jit(mosaic)(xj)), "xla": np.asarray(jax.jit(jnp.exp)(xj))}
    got["numpy_f32"] = np.exp(x32)
    out = {}
    for name, y in got.items():
        rel = np.abs(y.astype(np.float64) - want) / want
        out[name] = {"max_ulps": round(float(rel.max()) / _ULP, 2),
                     "mean_ulps": round(float(rel.mean()) / _ULP, 3)}  # fmt: skip
    return out


def precision(ctx) -> dict:
    return {"attention": attention(), "exp": exp()}
