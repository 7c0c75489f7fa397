"""One run of every sharding check, shared by the tests of this directory.

The checks need 8 simulated CPU devices, and ``--xla_force_host_platform_device_count``
only takes effect before JAX starts its backend, so they run in subprocesses, never in
the pytest process (whose other tests keep one device). Two subprocesses start together
at the first sharding test: ``python -m tests.sharding._cases`` (every single-process
case, results as JSON) and examples/launch_multiprocess.py (two ``jax.distributed``
processes with 4 devices each running examples/tp_generate.py). Each test then asserts
on its part of the results. Under pytest-xdist they still run once (see
``sharding_runs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 400
# Per launch of the 2-process example (about 25 s on a loaded 2-core machine); a gloo
# rendezvous that hangs (seen intermittently under load) is retried by the launcher.
LAUNCH_TIMEOUT_S = 120


def _run_all() -> dict:
    """Both subprocesses, started together; {"cases": {name: outcome}, "multi": [code, out]}."""
    # The suite's other XLA flags (its compile level, tests/conftest.py) are kept.
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    launcher = [
        sys.executable,
        "examples/launch_multiprocess.py",
        "--processes=2",
        "--devices-per-process=4",
        f"--timeout={LAUNCH_TIMEOUT_S}",
        "--retries=2",
        "examples/tp_generate.py",
        "--tp=8",
        "--new-tokens=2",
    ]
    cases = subprocess.Popen([sys.executable, "-m", "tests.sharding._cases"], env=env, **pipes)
    multi = subprocess.Popen(launcher, env=dict(env, XLA_FLAGS=flags), **pipes)
    try:
        out, _ = cases.communicate(timeout=TIMEOUT_S)
        line = [x for x in out.splitlines() if x.startswith("TORCHJAX_RESULTS ")]
        results = (
            json.loads(line[-1].split(" ", 1)[1])
            if line
            else {"crash": f"exit {cases.returncode}:\n{out[-6000:]}"}
        )
        multi_out, _ = multi.communicate(timeout=TIMEOUT_S + 30)
        return {"cases": results, "multi": [multi.returncode, multi_out]}
    finally:
        for p in (cases, multi):
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.fixture(scope="session")
def sharding_runs(request, tmp_path_factory) -> dict:
    """The results of ``_run_all``, computed once per test run: under pytest-xdist the
    first worker to get here runs it and the others read its JSON file (the recipe in
    pytest-xdist's docs: a file lock in the base temp dir the workers share)."""
    if getattr(request.config, "workerinput", None) is None:
        return _run_all()
    shared = tmp_path_factory.getbasetemp().parent / "torchjax_sharding_runs.json"
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(_run_all()))
        return json.loads(shared.read_text())


@pytest.fixture(scope="session")
def check(sharding_runs):
    """``check(name)``: fail with the case's traceback unless it passed; returns its value."""

    def run(name: str):
        results = sharding_runs["cases"]
        assert "crash" not in results, f"the sharding cases crashed ({results.get('crash')})"
        assert name in results, f"no case {name!r} in tests/sharding/_cases.py"
        outcome = results[name]
        if not outcome["ok"]:
            pytest.fail(f"case {name} failed in the 8-device subprocess:\n{outcome['error']}")
        return outcome.get("value")

    return run
