"""Run Python code in a child process that imports this checkout: tests of crashes,
process-wide state and resident memory need a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
