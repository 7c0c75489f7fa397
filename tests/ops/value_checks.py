"""A call torch refuses by its values, run on CPU and on tpu: eager, under torchjax.jit and
under torch.compile(backend="tpu"), for the tests of value checks (Note [Device-side
checks] in torchjax/device/_checks.py)."""

from __future__ import annotations

import torch
import torch._dynamo

import torchjax

MODES = ("eager", "jit", "compile")


class Host:
    """An argument kept on CPU when the others move to tpu (CTC's CPU length tensors)."""

    def __init__(self, value):
        self.value = value


def _on(device, args):
    out = []
    for a in args:
        if isinstance(a, Host):
            out.append(a.value)
        elif isinstance(a, torch.Tensor):
            out.append(a.to(device))
        else:
            out.append(a)
    return out


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpu")


def _call(mode, fn):
    if mode == "cpu" or mode == "eager":
        return fn
    if mode == "jit":
        return torchjax.jit(fn)
    return _compiled(fn)


def outcome(mode, fn, *args):
    """``("op" | "sync", type, text)`` of the error ``fn(*args)`` raises in ``mode``
    ("cpu" or one of MODES), by the call or at the next synchronisation point, or
    ``("ok", None, values)``: tensor arguments on tpu (but ``Host`` ones), traced under jit."""
    device = "cpu" if mode == "cpu" else "tpu"
    args = _on(device, args)
    try:
        out = _call(mode, fn)(*args)
    except Exception as error:  # noqa: BLE001 - compared against CPU's by the caller
        return ("op", type(error), str(error))
    try:
        values = out.cpu().tolist() if isinstance(out, torch.Tensor) else out
        torch.tpu.synchronize()
    except Exception as error:  # noqa: BLE001
        return ("sync", type(error), str(error))
    return ("ok", None, values)


def assert_refused_as_cpu(fn, *args, deferred_in: str | None = None) -> int:
    """``fn(*args)`` raises on tpu, in every mode, CPU's exception with CPU's text. A
    check made at the op raises by the call, CPU's text word for word; a deferred one
    (``deferred_in``: the ATen op it names) at the next synchronisation point, with
    ``(in aten::<op>)`` after CPU's text. Returns how many modes were compared."""
    where, exc, text = outcome("cpu", fn, *args)
    assert where == "op", f"CPU accepted the call: {text}"
    want = ("sync", exc, f"{text} (in aten::{deferred_in})") if deferred_in else ("op", exc, text)
    compared = 0
    for mode in MODES:
        got = outcome(mode, fn, *args)
        assert got == want, f"{mode}: {got} != {want}"
        compared += 1
    return compared


def assert_computes_as_cpu(fn, *args) -> int:
    """``fn(*args)`` raises nothing and gives CPU's values in every mode; returns how many
    modes were compared."""
    status, _, want = outcome("cpu", fn, *args)
    assert status == "ok", want
    compared = 0
    for mode in MODES:
        status, exc, got = outcome(mode, fn, *args)
        assert status == "ok", f"{mode}: {exc}: {got}"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=mode)
        compared += 1
    return compared
