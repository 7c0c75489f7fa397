"""Run Python code in a child process that imports this checkout: tests of crashes,
process-wide state and resident memory need a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    """``code`` (dedented) run by this interpreter with the checkout on PYTHONPATH."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        cwd=ROOT,
        timeout=timeout,
    )


def once_per_run(request, tmp_path_factory, name: str, make):
    """``make()`` (JSON data) computed once per test run, for a module-scoped fixture that
    several tests share: pytest-xdist sends a module's tests to both workers (its first
    tests one by one, in turn), so the first worker to ask computes it and the others
    read its file (the recipe in pytest-xdist's docs, as in tests/sharding/conftest.py)."""
    if getattr(request.config, "workerinput", None) is None:
        return make()
    shared = tmp_path_factory.getbasetemp().parent / f"torchjax_{name}.json"
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(make()))
        return json.loads(shared.read_text())


def completed(out: subprocess.CompletedProcess) -> dict:
    """What ``once_per_run`` can store of a finished child."""
    return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
