"""Runs every benchmark in bench/ in one process, prints their tables, and writes
bench/results.md and bench/results.png.

Run:  python -m bench   (or  python bench/run_all.py)

The machine's load average is recorded before and after: the figures are medians, but
a busy machine still inflates them; re-run when the load is high.
"""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench import decode, eager_overhead, models, startup  # noqa: E402
from bench.common import header  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _targets(ops, mdl, cold=None) -> str:
    def r(a, b):
        return None if isinstance(a, str) or isinstance(b, str) else a / b

    m = dict(mdl)
    rows = []
    for name, row in ops:  # the limit: one cached jax.jit call (bench/eager_overhead.py)
        bound = 2.0 if " 1x1 " in name else 1.25
        rows.append((f"{name} <= {bound}x jit", r(row["torchjax"], row["jit"]), bound))
    mini = m["MiniLM (8, 32)"]
    rows.append(("MiniLM forward <= 0.5x torchax", r(mini["torchjax"], mini["torchax"]), 0.5))
    lines = ["| target | ratio | met |", "|---|---:|---|"]
    for (dtype, mode), runs in (cold or {}).items():  # absolute targets: value / bound
        for which, key, bound, unit in (
            ("cold", "wall_s", 5.0, "s"),
            ("cold", "compiles", 100, "compiles"),
            ("warm", "wall_s", 1.0, "s"),
        ):
            rows.append(
                (
                    f"{dtype} first generate ({mode}), {which}: <= {bound} {unit}",
                    runs[which][key] / bound,
                    1.0,
                )
            )
    for name, value, bound in rows:
        if value is None:
            lines.append(f"| {name} | n/a | n/a |")
        else:
            lines.append(f"| {name} | {value:.2f}x | {'yes' if value <= bound else 'no'} |")
    return "\n".join(lines)


def _chart(ops, mdl, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "torchjax": "C0",
        "jit": "C3",
        "jnp": "C2",
        "raw jnp": "C2",
        "torchax": "C1",
        "torch CPU": "C7",
    }
    fig, axes = plt.subplots(1, 2, figsize=(22, 6), gridspec_kw={"width_ratios": [8, 2]})
    panels = (
        (axes[0], ops, "eager op latency", ["torchjax", "jit", "jnp", "torchax", "torch CPU"]),
        (axes[1], mdl, "model forward", ["torchjax", "raw jnp", "torchax", "torch CPU"]),
    )
    for ax, rows, title, impls in panels:
        names = [n for n, _ in rows]
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, (_, r) in enumerate(rows):
                v = r.get(impl)
                if isinstance(v, (int, float)):
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(v)
            if ys:
                ax.bar(xs, ys, width, label=impl, color=colors[impl])
        ax.set_yscale("log")
        ax.set_ylabel("microseconds (median, log scale; lower is better)")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=6)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    load_before = _load()
    head = header("torchjax benchmarks (eager)")
    print(head)
    ops = eager_overhead.run()
    ops_table = eager_overhead.report(ops)
    print("\n" + ops_table)
    mdl = models.run()
    mdl_table = models.report(mdl)
    print("\n" + mdl_table)
    fused_table = models.fused_report(
        [(name, models.time_fused(dt)) for name, dt in models.FUSED_ROWS]
    )
    print("\n" + fused_table)
    dec = decode.run()
    dec_table = decode.report(dec)
    print("\n" + dec_table)
    # float32 and bfloat16, each mode cold and warm: eight fresh processes.
    cold = startup.run()
    cold_table = startup.report(cold)
    print("\n" + cold_table)
    targets = _targets(ops, mdl, cold)
    print("\n" + targets)
    load_after = _load()
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {load_after}")
    md = "\n\n".join(
        [
            head,
            "Command: `python -m bench` (bench/run_all.py). Medians; every timed call blocks "
            "on its result. See bench/eager_overhead.py, bench/models.py, bench/decode.py for "
            "what is measured.",
            f"Machine load average (1, 5, 15 min): before {load_before}; after {load_after}.",
            "## Eager per-op latency\n\n" + ops_table,
            "## Model forward (eager)\n\n" + mdl_table,
            "## Fused eager forward\n\n" + fused_table,
            "## Decode (eager)\n\n" + dec_table,
            "## Cold start (fresh processes)\n\n" + cold_table,
            "## Targets\n\n" + targets,
            "![chart](results.png)",
        ]
    )
    (HERE / "results.md").write_text(md + "\n")
    _chart(ops, mdl, HERE / "results.png")
    print(f"\nwrote {HERE / 'results.md'} and {HERE / 'results.png'}")


if __name__ == "__main__":
    main()
