"""Run third-party test suites (transformers, PyTorch) on CPU and on "tpu" and compare.

`python -m tools.suites transformers tests/models/llama/test_modeling_llama.py` gets
transformers' tests from the installed version's source distribution at run time, runs the
file once on CPU (torchjax not imported) and once on "tpu" (`TRANSFORMERS_TEST_DEVICE=tpu`
and a device spec that imports torchjax), and prints what passes where and why the
CPU-passing tests fail on "tpu". `python -m tools.suites pytorch --folder DIR test_view_ops.py`
does the same for PyTorch's device-generic test files brought in by the user.

Nothing fetched is committed: it all lives under the ignored cache folder (`.suites-cache/`).
See docs/testing.md.
"""

import json
from pathlib import Path


def folder_sources(folder: Path):
    """Where a --folder's files came from: its SOURCES.json, {file: {repo, commit[, edited]}}."""
    path = folder / "SOURCES.json"
    if not path.exists():
        return ["no SOURCES.json in the folder: the files' repository and commit are unknown"]
    notes = []
    for name, s in sorted(json.loads(path.read_text()).items()):
        edited = f" (edited: {s['edited']})" if s.get("edited") else ""
        notes.append(f"{name}: {s['repo']} at {s['commit']}{edited}")
    return notes
