"""How exactly the value product in bfloat16 pieces reproduces CPU torch, on CPU.

``torch.ops.torchjax.exact_attention`` multiplies the float32 probabilities by the
bfloat16 values either in float32 at HIGHEST (``highest``) or as the sum of 2 or 3
bfloat16 pieces of the probabilities times v (``split2``, ``split3``; Note [The value
product in pieces] in torchjax/pallas/_sdpa_math.py). Each row runs
:func:`torchjax.pallas.exact_attention` with one choice on bf16 inputs (GQA, causal,
bool and float masks, a scale, a long key sequence; several seeds and input scales)
and ``jax.vjp`` of it, and counts against CPU torch's bf16
``F.scaled_dot_product_attention`` (and its gradients of q, k, v for a random
cotangent), against float64 attention of the same inputs rounded once to bf16, and
against ``highest``: elements that differ, and the largest difference in bf16
epsilons of the reference's largest magnitude. ``*_autodiff`` rows take JAX's own
derivative of the split instead of its custom VJP.

Run:  python bench/attention_split_exactness.py [--seeds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchjax.pallas import _sdpa_math  # noqa: E402

# name -> (q, k, v shapes, SDPA keywords; "bool"/"float": the mask's shape)
CONFIGS = {
    "gqa-causal": ((2, 8, 96, 64), (2, 2, 96, 64), (2, 2, 96, 64), {"is_causal": True}),
    "mha-cross": ((2, 4, 80, 32), (2, 4, 120, 32), (2, 4, 120, 32), {}),
    "gqa-bool-mask": ((1, 4, 64, 64), (1, 2, 100, 64), (1, 2, 100, 64), {"bool": (1, 1, 64, 100)}),
    "float-mask-scale": (
        (2, 4, 50, 16), (2, 4, 70, 16), (2, 4, 70, 24), {"float": (2, 1, 50, 70), "scale": 0.3}
    ),
    "long-keys": ((1, 2, 16, 128), (1, 2, 1024, 128), (1, 2, 1024, 128), {}),
}  # fmt: skip
ROWS = ("highest", "split2", "split3", "split2_autodiff", "split3_autodiff")
EPS = 2.0**-7  # bfloat16's epsilon


@contextlib.contextmanager
def _autodiff():
    """The split without its custom VJP: JAX differentiates the pieces' products."""
    split = _sdpa_math._split_product
    _sdpa_math._split_product = lambda p, v, n: _sdpa_math._products(
        _sdpa_math._pieces(p, n), v, "...hgls,...hse->...hgle"
    ).astype(v.dtype)
    try:
        yield
    finally:
        _sdpa_math._split_product = split


def _jax(t):
    return (
        jnp.asarray(t.numpy())
        if t.dtype == torch.bool
        else jnp.asarray(t.float().numpy(), jnp.bfloat16)
    )


def _torch(a):
    return torch.tensor(np.asarray(a.astype(jnp.float32))).to(torch.bfloat16)


def _ours(row, q, k, v, kw, ct):
    mask = kw.get("attn_mask")
    mask = None if mask is None else _jax(mask)
    causal, scale = kw.get("is_causal", False), kw.get("scale")
    choice = row.split("_")[0]

    def f(q, k, v):
        return _sdpa_math.exact_attention(q, k, v, mask, causal, scale, choice)

    with _autodiff() if row.endswith("_autodiff") else contextlib.nullcontext():
        out, pull = jax.vjp(f, _jax(q), _jax(k), _jax(v))
        grads = pull(_jax(ct))
    return [_torch(a) for a in (out, *grads)]


def _case(name, seed):
    g = torch.Generator().manual_seed(seed)
    *shapes, kw = CONFIGS[name]
    kw = dict(kw, enable_gqa=shapes[0][1] != shapes[1][1])
    q, k, v = (
        torch.randn(*s, generator=g).mul(1 + 2 * (seed % 3)).to(torch.bfloat16) for s in shapes
    )
    if "bool" in kw:
        kw["attn_mask"] = torch.rand(*kw.pop("bool"), generator=g) > 0.3
    if "float" in kw:
        kw["attn_mask"] = torch.randn(*kw.pop("float"), generator=g).to(torch.bfloat16)
    return (q, k, v), kw, g


def _cpu(q, k, v, kw, g):
    """CPU torch's bf16 output and gradients, the cotangent, and float64's output in bf16."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kw)
    ct = torch.randn(*out.shape, generator=g).to(torch.bfloat16)
    grads = torch.autograd.grad(out, leaves, ct)
    kw64 = {
        n: a.double() if torch.is_tensor(a) and a.is_floating_point() else a for n, a in kw.items()
    }
    out64 = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), **kw64)
    return [out.detach(), *grads], ct, out64.to(torch.bfloat16)


def _tally(acc, key, got, want):
    acc[f"{key}_differ"] = acc.get(f"{key}_differ", 0) + int((got != want).sum())
    share = float((got.float() - want.float()).abs().max() / want.float().abs().max()) / EPS
    acc[f"{key}_max_eps"] = round(max(acc.get(f"{key}_max_eps", 0.0), share), 3)


def run(seeds: int) -> dict:
    report = {row: {} for row in ROWS}
    sizes = {"outputs": 0, "grads": 0}
    for seed in range(seeds):
        for name in CONFIGS:
            (q, k, v), kw, g = _case(name, seed)
            torch_res, ct, out64 = _cpu(q, k, v, kw, g)
            sizes["outputs"] += torch_res[0].numel()
            sizes["grads"] += sum(t.numel() for t in torch_res[1:])
            ours = {row: _ours(row, q, k, v, kw, ct) for row in ROWS}
            for row, res in ours.items():
                acc = report[row]
                _tally(acc, "out_vs_torch", res[0], torch_res[0])
                _tally(acc, "out_vs_float64", res[0], out64)
                _tally(acc, "out_vs_highest", res[0], ours["highest"][0])
                for got, want, high in zip(res[1:], torch_res[1:], ours["highest"][1:]):
                    _tally(acc, "grad_vs_torch", got, want)
                    _tally(acc, "grad_vs_highest", got, high)
    return {"elements": sizes, **report}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print(json.dumps(run(args.seeds), indent=1))


if __name__ == "__main__":
    main()
