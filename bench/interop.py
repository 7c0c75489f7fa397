"""Cost of crossing between PyTorch and JAX: a to_jax/from_jax round trip (zero copy,
so it should not grow with the tensor) next to a ``.cpu()`` copy, for three sizes.

Run:  python bench/interop.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import torch  # noqa: E402

import torchjax  # noqa: E402
from bench.common import fmt_us, header, median_us  # noqa: E402

SIZES = {"4 KB": (1024,), "4 MB": (1024, 1024), "64 MB": (4096, 4096)}


def results() -> dict:
    out = {}
    for label, shape in SIZES.items():
        t = torch.randn(*shape).to("tpu")
        jax.block_until_ready(t.jax())

        def round_trip(t=t):
            return torchjax.from_jax(torchjax.to_jax(t))

        assert round_trip().jax().unsafe_buffer_pointer() == t.jax().unsafe_buffer_pointer()
        out[(label, "to_jax + from_jax")] = median_us(round_trip, runs=2000)
        out[(label, "torch.from_dlpack (tpu -> CPU view)")] = median_us(
            lambda t=t: torch.from_dlpack(t), runs=2000
        )
        out[(label, ".cpu() copy")] = median_us(lambda t=t: t.cpu(), runs=20, warmup=3)
    return out


def main() -> str:
    res = results()
    lines = [header("Interop: crossing cost"), "", "| size | operation | median |", "|---|---|---|"]
    for (label, op), us in res.items():
        lines.append(f"| {label} | {op} | {fmt_us(us)} |")
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
