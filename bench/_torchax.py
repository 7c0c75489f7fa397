"""torchax (0.0.13) as a benchmark peer, with the shim it needs on torch 2.13.

torchax 0.0.13 names ATen overloads that torch 2.13 removed (the named-tensor
overloads: ``aten.prod.dim_Dimname``, ``aten.all.dimname``,
``aten.norm.names_ScalarOpt_dim``, ...) at import time and when it builds its
environment, as dict keys and decomposition lists, so ``import torchax`` raises
AttributeError. ``load()`` imports it and builds its environment with missing overload
lookups answered by inert placeholders (no op ever dispatches to a removed overload),
then restores torch; ``placeholders()`` lists the names it stood in for.
This lives in bench/ only: torchjax never imports torchax.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import torch

_STATE: dict = {}

# What a torchax run of a benchmark may raise for an op or model it cannot run (with
# ``torchax.tensor.OperatorNotFound``): the table then says "n/a" and why.
TORCHAX_ERRORS = (NotImplementedError, RuntimeError, TypeError, AttributeError, ValueError)


class _RemovedOverload:
    """Stands in for an overload torch removed; hashable, never called."""

    def __init__(self, packet, name):
        self.name = f"{packet._qualified_op_name}.{name} (removed in torch 2.13)"

    def __repr__(self):
        return self.name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(self.name)


@contextlib.contextmanager
def _removed_overloads_as_placeholders():
    packet_cls = torch._ops.OpOverloadPacket
    original = packet_cls.__getattr__
    made: dict = {}

    def getattr_(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            return made.setdefault((id(self), key), _RemovedOverload(self, key))

    _STATE["placeholders"] = made

    packet_cls.__getattr__ = getattr_
    try:
        yield
    finally:
        packet_cls.__getattr__ = original


def load():
    """The torchax module, or None with the reason in ``reason()``."""
    if "module" in _STATE:
        return _STATE["module"]
    try:
        with _removed_overloads_as_placeholders():
            import torchax

            # The environment loads torchax's op tables (jaten, decompositions) lazily:
            # build it while the shim is active.
            torchax.default_env()
    except (ImportError, AttributeError, RuntimeError, TypeError) as error:
        # Any of these at import means the peer is unavailable: the bench says why.
        _STATE["module"] = None
        _STATE["reason"] = f"torchax import failed: {type(error).__name__}: {error}"
        return None
    _STATE["module"] = torchax
    _STATE["reason"] = ""
    return torchax


def placeholders() -> list[str]:
    """The removed overloads the shim stood in for."""
    load()
    return sorted(p.name for p in _STATE.get("placeholders", {}).values())


def reason() -> str:
    load()
    return _STATE.get("reason", "")


def version() -> str:
    tx = load()
    return tx.__version__ if tx is not None else "unavailable"


def measure(suite: str, timeout_s: int = 1200) -> dict:
    """{case name: median microseconds (or tokens/s for "decode"), or "n/a (why)"} for
    one suite ("ops", "models", "decode", "compiled"), measured with torchax in a child process."""
    cmd = [sys.executable, "-m", "bench._torchax", suite]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"*": f"n/a (torchax run exceeded {timeout_s} s)"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]
        return {"*": f"n/a (torchax run failed: {err})"}
    return json.loads(lines[-1])


def _main(suite: str) -> None:
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    tx = load()
    if tx is None:
        print(json.dumps({"*": f"n/a ({reason()})"}))
        return
    if suite == "ops":
        from bench import eager_overhead as mod
    elif suite == "models":
        from bench import models as mod
    elif suite == "compiled":
        from bench import compiled as mod
    else:
        from bench import decode as mod
    print(json.dumps(mod.torchax_results(tx)))


if __name__ == "__main__":
    _main(sys.argv[1])
