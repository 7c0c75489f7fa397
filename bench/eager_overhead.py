"""Per-op eager latency: torchjax vs raw jax.numpy vs native torch CPU vs torchax.

Each figure is the median of ``RUNS`` timed calls (after warm-up calls, which also
compile torchjax's per-op executables) of one op on the same float32 data, blocking on
the result inside the timed region (``jax.block_until_ready``), so it is the latency a
user sees op by op. "raw jnp" is the same math written with jax.numpy/lax calls, eager
(not jitted): ``jnp.add``, ``x @ y``, and for layer_norm, gelu, softmax and SDPA the
composition of jnp ops a user would write. Ratios: torchjax / raw jnp (the cost of the
bridge) and torchjax / torchax.

Run:  python bench/eager_overhead.py
"""

from __future__ import annotations

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from jax import lax  # noqa: E402

from bench import _torchax  # noqa: E402
from bench._torchax import TORCHAX_ERRORS as _TORCHAX_ERRORS  # noqa: E402
from bench.common import fmt_us, header, median_us, ratio  # noqa: E402

RUNS = 300


def _jnp_layer_norm(x, w, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * w + b


def _jnp_gelu(x):
    return x * 0.5 * (1 + lax.erf(x * (1 / math.sqrt(2))))


def _jnp_softmax(x):
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _jnp_sdpa(q, k, v):
    s = (q @ jnp.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]))
    return _jnp_softmax(s) @ v


def cases():
    """(name, input shapes, torch fn over tensors, raw jnp fn over arrays)."""
    ln_w = np.random.default_rng(1).standard_normal(512, dtype=np.float32)
    ln_b = np.random.default_rng(2).standard_normal(512, dtype=np.float32)
    return [
        ("add 1x1", [(1, 1), (1, 1)], lambda x, y: x + y, jnp.add),
        ("add 256x256", [(256, 256), (256, 256)], lambda x, y: x + y, jnp.add),
        ("matmul 256", [(256, 256), (256, 256)], lambda x, y: x @ y, jnp.matmul),
        (
            "layer_norm (64, 512)",
            [(64, 512), ln_w, ln_b],
            lambda x, w, b: F.layer_norm(x, (512,), w, b),
            _jnp_layer_norm,
        ),
        ("gelu (64, 512)", [(64, 512)], F.gelu, _jnp_gelu),
        ("softmax (64, 512)", [(64, 512)], lambda x: torch.softmax(x, -1), _jnp_softmax),
        (
            "SDPA (1, 8, 128, 64)",
            [(1, 8, 128, 64)] * 3,
            F.scaled_dot_product_attention,
            _jnp_sdpa,
        ),
    ]


def _inputs(specs):
    rng = np.random.default_rng(0)
    return [
        s if isinstance(s, np.ndarray) else rng.standard_normal(s, dtype=np.float32) for s in specs
    ]


def time_case(specs, torch_fn, jnp_fn) -> dict:
    """Median microseconds of one op for torchjax, raw jnp and torch CPU."""
    import torchjax

    arrays = _inputs(specs)
    cpu = [torch.from_numpy(a) for a in arrays]
    tpu = [t.to("tpu") for t in cpu]
    jx = [jnp.asarray(a) for a in arrays]
    with torch.no_grad():
        out = {
            "torchjax": median_us(
                lambda: jax.block_until_ready(torchjax.to_jax(torch_fn(*tpu))), runs=RUNS
            ),
            "raw jnp": median_us(lambda: jax.block_until_ready(jnp_fn(*jx)), runs=RUNS),
            "torch CPU": median_us(lambda: torch_fn(*cpu), runs=RUNS),
        }
    return out


def torchax_results(tx) -> dict:
    """{op name: torchax median microseconds or "n/a (why)"} (run by bench/_torchax.py
    in a process without torchjax)."""
    out = {}
    env = tx.default_env()
    for name, specs, torch_fn, _ in cases():
        cpu = [torch.from_numpy(a) for a in _inputs(specs)]
        try:
            with env, torch.no_grad():
                args = [t.to("jax") for t in cpu]
                out[name] = median_us(
                    lambda f=torch_fn, a=args: jax.block_until_ready(f(*a).jax()), runs=RUNS
                )
        except (*_TORCHAX_ERRORS, tx.tensor.OperatorNotFound) as error:
            out[name] = f"n/a (torchax: {type(error).__name__})"
    return out


def run() -> list[tuple[str, dict]]:
    rows = [(name, time_case(specs, tf, jf)) for name, specs, tf, jf in cases()]
    tax = _torchax.measure("ops")
    for name, r in rows:
        r["torchax"] = tax.get(name, tax.get("*", "n/a (not measured)"))
    return rows


def report(rows) -> str:
    lines = [
        "| op | torchjax | raw jnp | torch CPU | torchax | torchjax/jnp | torchjax/torchax |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {fmt_us(r['torchjax'])} | {fmt_us(r['raw jnp'])} | "
            f"{fmt_us(r['torch CPU'])} | {fmt_us(r['torchax'])} | "
            f"{ratio(r['torchjax'], r['raw jnp'])} | {ratio(r['torchjax'], r['torchax'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    print(header("eager per-op latency"))
    print(report(run()))


if __name__ == "__main__":
    main()
