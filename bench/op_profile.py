"""Device time per XLA operation of a few calls, from a ``jax.profiler`` trace.

``profile(call, steps, out_dir)`` runs ``call()`` ``steps`` times under
``jax.profiler.trace`` and reads the trace back with ``jax.profiler.ProfileData``: on a
TPU, the events of the device plane's "XLA Ops" line; elsewhere, host events that carry
an ``hlo_op`` stat (XLA:CPU's thunks). It returns the total device time per step, the
time per operation kind (the HLO name without its ``.N`` suffix, with the event's
``hlo_category`` where the profiler records one) and the slowest operations, so two
programs of the same model (torchjax's and pure JAX's) can be compared op by op. The
trace file stays in ``out_dir`` for a closer look (xprof, or ``ProfileData.from_file``).
"""

from __future__ import annotations

import collections
import pathlib
import re

_SUFFIX = re.compile(r"\.\d+$")


def _stats(event) -> dict:
    out = {}
    for key, value in event.stats:
        out[key] = value
    return out


def _device_events(data):
    """(name, duration ns, stats) of each device operation in the trace."""
    tpu = [p for p in data.planes if p.name.startswith("/device:TPU")]
    if tpu:
        for plane in tpu[:1]:  # one chip: the first device
            for line in plane.lines:
                if line.name == "XLA Ops":
                    for e in line.events:
                        yield e.name, e.duration_ns, _stats(e)
        return
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                stats = _stats(e)
                if "hlo_op" in stats:
                    yield e.name, e.duration_ns, stats


def summarize(path: str, steps: int, top: int = 40) -> dict:
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    by_op = collections.Counter()
    by_kind = collections.Counter()
    counts = collections.Counter()
    detail = {}
    keys = set()
    for name, ns, stats in _device_events(data):
        keys.update(stats)
        by_op[name] += ns
        counts[name] += 1
        category = stats.get("hlo_category") or stats.get("category")
        kind = f"{category}" if category else _SUFFIX.sub("", name)
        by_kind[kind] += ns
        if name not in detail:
            text = stats.get("long_name") or stats.get("tf_op") or ""
            detail[name] = str(text)[:200]
    total = sum(by_op.values())
    ms = 1e-6 / max(steps, 1)
    return {
        "device_ms_per_step": round(total * ms, 3),
        "by_kind_ms": {k: round(v * ms, 3) for k, v in by_kind.most_common(25)},
        "top_ops": [
            (n, round(v * ms, 3), counts[n] // max(steps, 1), detail[n])
            for n, v in by_op.most_common(top)
        ],
        "stat_keys": sorted(keys)[:40],
    }


def profile(call, steps: int, out_dir: str, top: int = 40) -> dict:
    """Runs ``call()`` ``steps`` times under the profiler; the summary of its trace."""
    import jax

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out)):
        for _ in range(steps):
            call()
    found = sorted(out.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        return {"error": f"no trace written under {out}"}
    row = summarize(str(found[-1]), steps, top)
    row["trace"] = str(found[-1])
    return row
