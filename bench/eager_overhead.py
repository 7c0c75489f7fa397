"""Per-op eager latency on "tpu": torchjax vs raw jax.numpy vs native torch CPU.

Each figure is the median of 200 timed calls (after 20 warm-up calls) of one op on the
same float32 data, blocking on the result inside the timed region
(``jax.block_until_ready``), so it is the latency a user sees op by op. Ratios are
torchjax / raw jnp (the cost of the bridge) and torchjax / torch CPU.

Run:  python bench/eager_overhead.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torchjax  # noqa: E402
from bench.common import header, median_us  # noqa: E402


def cases():
    rng = np.random.default_rng(0)

    def arrays(shape):
        return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(
            shape, dtype=np.float32
        )

    a1, b1 = arrays((1, 1))
    a2, b2 = arrays((256, 256))
    return [
        ("add 1x1", a1, b1, lambda x, y: x + y, jnp.add),
        ("add 256x256", a2, b2, lambda x, y: x + y, jnp.add),
        ("matmul 256", a2, b2, lambda x, y: x @ y, jnp.matmul),
    ]


def time_case(a, b, torch_fn, jnp_fn) -> tuple[float, float, float]:
    """(torchjax, raw jnp, torch CPU) median microseconds for one op on (a, b)."""
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    xa, xb = ta.to("tpu"), tb.to("tpu")
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    t_tj = median_us(lambda: jax.block_until_ready(torchjax.to_jax(torch_fn(xa, xb))))
    t_jnp = median_us(lambda: jax.block_until_ready(jnp_fn(ja, jb)))
    t_cpu = median_us(lambda: torch_fn(ta, tb))
    return t_tj, t_jnp, t_cpu


def run() -> list[tuple[str, float, float, float]]:
    return [(name, *time_case(a, b, tf, jf)) for name, a, b, tf, jf in cases()]


def report(rows) -> str:
    lines = [
        "| op | torchjax eager (us) | raw jnp (us) | torch CPU (us) | torchjax/jnp "
        "| torchjax/torch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, tj, jn, cpu in rows:
        lines.append(
            f"| {name} | {tj:.1f} | {jn:.1f} | {cpu:.1f} | {tj / jn:.2f}x | {tj / cpu:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    print(header("eager per-op latency"))
    print(report(run()))


if __name__ == "__main__":
    main()
