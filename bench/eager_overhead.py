"""Per-op eager latency: torchjax vs the same computation as one cached ``jax.jit`` call.

The limit for one eager op is the same computation as one cached ``jax.jit`` call on
committed jax arrays ("jit", the column every ratio is taken against); beside it, the
same math as unjitted jax.numpy ("jnp", one jax dispatch per primitive), native torch
CPU, and torchax when it is installed (in a child process). Rows: float32, bfloat16,
float16 and int64 of add, mul by a Python scalar, matmul, layer_norm, softmax,
embedding, index_select, ``x[idx]``, ``index_put_`` and (int64) ``//``, each at 1x1
and at 256x256 (layer_norm/softmax: (64, 512); embedding/indexing: a (256, 256) table
and 64 indices). Each figure is the median of ``RUNS`` calls after warm-up calls
(which compile), blocking on the result inside the timed region.

The "XLA/call" and "reads/call" columns are torchjax's own counters
(``torchjax.stats()``): XLA executions and device-to-host reads per op call.

Run:  python bench/eager_overhead.py          (a few minutes on a loaded 2-core machine)
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import _torchax  # noqa: E402
from bench._torchax import TORCHAX_ERRORS as _TORCHAX_ERRORS  # noqa: E402
from bench.common import fmt_us, header, median_us, ratio  # noqa: E402

RUNS = 100
WARMUP = 10
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
_JNP_DTYPES = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int64: jnp.int64,
}


def _jnp_layer_norm(x, w, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _jnp_softmax(x):
    xf = x.astype(jnp.float32)
    e = jnp.exp(xf - jnp.max(xf, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


def _jnp_mul(x):
    return x * jnp.asarray(2 if jnp.issubdtype(x.dtype, jnp.integer) else 0.5, x.dtype)


def _scalar_for(x):
    return 2 if not x.is_floating_point() else 0.5


def _index_put(x, i, v):
    return x.index_put_((i,), v)


def _cases(small: bool):
    """(op, specs, torch fn, jnp fn, int ok, float ok): specs are ("x", shape) for data in
    the row's dtype and ("i", n, high) for int64 indices below ``high``."""
    n = 1 if small else 256
    ln = (1, 1) if small else (64, 512)
    k = 1 if small else 64
    return [
        ("add", [("x", (n, n)), ("x", (n, n))], lambda x, y: x + y, jnp.add, True, True),
        ("mul scalar", [("x", (n, n))], lambda x: x * _scalar_for(x), _jnp_mul, True, True),
        ("matmul", [("x", (n, n)), ("x", (n, n))], lambda x, y: x @ y, jnp.matmul, True, True),
        (
            "layer_norm",
            [("x", ln), ("x", ln[-1:]), ("x", ln[-1:])],
            lambda x, w, b: F.layer_norm(x, ln[-1:], w, b),
            _jnp_layer_norm,
            False,
            True,
        ),
        ("softmax", [("x", ln)], lambda x: torch.softmax(x, -1), _jnp_softmax, False, True),
        (
            "embedding",
            [("i", (k,), n), ("x", (n, n))],
            F.embedding,
            lambda i, w: jnp.take(w, i, axis=0),
            True,
            True,
        ),
        (
            "index_select",
            [("x", (n, n)), ("i", (k,), n)],
            lambda x, i: torch.index_select(x, 0, i),
            lambda x, i: jnp.take(x, i, axis=0),
            True,
            True,
        ),
        (
            "x[idx]",
            [("x", (n, n)), ("i", (k,), n)],
            lambda x, i: x[i],
            lambda x, i: x[i],
            True,
            True,
        ),
        (
            "index_put_",
            [("x", (n, n)), ("i", (k,), n), ("x", (k, n))],
            _index_put,
            lambda x, i, v: x.at[i].set(v),
            True,
            True,
        ),
        (
            "//",
            [("x", (n, n)), ("d", (n, n))],
            lambda x, y: x // y,
            jnp.floor_divide,
            True,
            False,
        ),
    ]


def cases():
    """(row name, dtype, specs, torch fn, jnp fn) for every measured row."""
    out = []
    for small in (True, False):
        for op, specs, tf, jf, int_ok, float_ok in _cases(small):
            for dt in DTYPES:
                if (dt.is_floating_point and float_ok) or (not dt.is_floating_point and int_ok):
                    size = (
                        "1x1"
                        if small
                        else ("(64,512)" if op in ("layer_norm", "softmax") else "256")
                    )
                    out.append((f"{op} {size} {str(dt)[6:]}", dt, specs, tf, jf))
    return out


def _inputs(dtype, specs):
    rng = np.random.default_rng(0)
    out = []
    for spec in specs:
        if spec[0] == "i":
            out.append(torch.from_numpy(rng.integers(0, spec[2], spec[1])))
        elif spec[0] == "d" or not dtype.is_floating_point:
            lo = 1 if spec[0] == "d" else -50
            out.append(torch.from_numpy(rng.integers(lo, 50, spec[1])).to(dtype))
        else:
            out.append(torch.from_numpy(rng.standard_normal(spec[1], dtype=np.float32)).to(dtype))
    return out


def _to_jax(t):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy(), jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _stats():
    import torchjax

    return torchjax.stats() if hasattr(torchjax, "stats") else None


def time_case(dtype, specs, torch_fn, jnp_fn) -> dict:
    """Median microseconds of one call for torchjax, the jitted limit, jnp and torch CPU."""
    import torchjax

    cpu = _inputs(dtype, specs)
    jitted = jax.jit(jnp_fn)
    with torch.no_grad(), jax.enable_x64(True):
        jx = [jax.device_put(_to_jax(t)) for t in cpu]
        tpu = [t.to("tpu") for t in cpu]

        def tj():
            jax.block_until_ready(torchjax.to_jax(torch_fn(*tpu)))

        out = {"torchjax": median_us(tj, warmup=WARMUP, runs=RUNS)}
        s0 = _stats()
        for _ in range(10):
            tj()
        s1 = _stats()
        if s0 is not None:
            out["xla"] = (s1["executions"] - s0["executions"]) / 10
            out["reads"] = (s1["host_reads"] - s0["host_reads"]) / 10
        out["jit"] = median_us(lambda: jax.block_until_ready(jitted(*jx)), warmup=WARMUP, runs=RUNS)
        out["jnp"] = median_us(lambda: jax.block_until_ready(jnp_fn(*jx)), warmup=WARMUP, runs=RUNS)
    out["torch CPU"] = median_us(lambda: torch_fn(*cpu), warmup=WARMUP, runs=RUNS)
    return out


def torchax_results(tx) -> dict:
    """{row name: torchax median microseconds or "n/a (why)"} (run by bench/_torchax.py
    in a process without torchjax)."""
    out = {}
    env = tx.default_env()
    for name, dt, specs, torch_fn, _ in cases():
        cpu = _inputs(dt, specs)
        try:
            with env, torch.no_grad():
                args = [t.to("jax") for t in cpu]
                out[name] = median_us(
                    lambda f=torch_fn, a=args: jax.block_until_ready(f(*a).jax()),
                    warmup=WARMUP,
                    runs=RUNS,
                )
        except (*_TORCHAX_ERRORS, tx.tensor.OperatorNotFound) as error:
            out[name] = f"n/a (torchax: {type(error).__name__})"
    return out


def run() -> list[tuple[str, dict]]:
    rows = [(name, time_case(dt, specs, tf, jf)) for name, dt, specs, tf, jf in cases()]
    tax = _torchax.measure("ops")
    for name, r in rows:
        r["torchax"] = tax.get(name, tax.get("*", "n/a (not measured)"))
    return rows


def _per_call(r, key):
    v = r.get(key)
    return "n/a" if v is None else f"{v:g}"


def report(rows) -> str:
    lines = [
        "| op | torchjax | jit (limit) | jnp | torch CPU | torchax | torchjax/jit "
        "| XLA/call | reads/call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    reasons = set()
    for name, r in rows:
        tax = r["torchax"]
        if isinstance(tax, str):
            reasons.add(tax)
            tax = "n/a"
        lines.append(
            f"| {name} | {fmt_us(r['torchjax'])} | {fmt_us(r['jit'])} | {fmt_us(r['jnp'])} | "
            f"{fmt_us(r['torch CPU'])} | {fmt_us(tax)} | "
            f"{ratio(r['torchjax'], r['jit'])} | {_per_call(r, 'xla')} | "
            f"{_per_call(r, 'reads')} |"
        )
    lines += [f"\ntorchax: {why}" for why in sorted(reasons)]
    return "\n".join(lines)


def main() -> None:
    print(header("eager per-op latency vs one cached jax.jit call"))
    print(report(run()))


if __name__ == "__main__":
    main()
