"""Device time per XLA operation of a few calls, from a ``jax.profiler`` trace.

``profile(call, steps, out_dir)`` runs ``call()`` ``steps`` times under
``jax.profiler.trace`` and reads the trace back with ``jax.profiler.ProfileData``: on a
TPU, the events of the device plane's "XLA Ops" line; elsewhere, host events that carry
an ``hlo_op`` stat (XLA:CPU's thunks). It returns the total device time per step, the
time per operation kind (``_kind``: opcode, fusion kind or custom call, read from the
HLO instruction a TPU event is named by) and the slowest operations, so two
programs of the same model (torchjax's and pure JAX's) can be compared op by op. The
trace file stays in ``out_dir`` for a closer look (xprof, or ``ProfileData.from_file``).
"""

from __future__ import annotations

import collections
import pathlib
import re

_SUFFIX = re.compile(r"\.\d+$")
# A TPU trace names each event by its HLO instruction: "%name = shape opcode(operands)..."
_INSTRUCTION = re.compile(r"^%(\S+) = .*? ([a-z][a-z0-9_-]*)\((.*)$")


def _kind(name: str) -> str:
    """An event's operation kind: the opcode, a fusion's kind ("fusion:kLoop") or a
    custom call's name ("custom-call:torchjax_flash_attention_fwd"); off a TPU, the
    event name without its ``.N`` suffix."""
    m = _INSTRUCTION.match(name)
    if m is None:
        return _SUFFIX.sub("", name)
    ident, opcode, rest = m.groups()
    if opcode == "fusion":
        kind = re.search(r"kind=(k\w+)", rest)
        return f"fusion:{kind.group(1) if kind else '?'}"
    if opcode == "custom-call":
        return f"custom-call:{_SUFFIX.sub('', ident)}"
    return opcode


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
    for name, ns, _ in _device_events(data):
        by_op[name] += ns
        counts[name] += 1
        by_kind[_kind(name)] += ns
    total = sum(by_op.values())
    ms = 1e-6 / max(steps, 1)
    return {
        "device_ms_per_step": round(total * ms, 3),
        "by_kind_ms": {k: round(v * ms, 3) for k, v in by_kind.most_common(25)},
        "top_ops": [
            (n[:300], round(v * ms, 3), counts[n] // max(steps, 1))
            for n, v in by_op.most_common(top)
        ],
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
