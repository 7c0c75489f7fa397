"""The ``examples`` extra installs what the docs' Python snippets import: a user who ran
README's main-job install (``pip install -e ".[examples]"``) can paste any of them."""

import importlib.metadata as md
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's)

ROOT = pathlib.Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)
_OURS = {"torchjax", "examples", "bench", "tests", "tools"}


def _requirement_names(specs):
    return {re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_every_snippet_import_is_installed_by_the_examples_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = _requirement_names(project["dependencies"])
    allowed |= _requirement_names(project["optional-dependencies"]["examples"])
    owners = md.packages_distributions()
    seen, missing = set(), {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _BLOCK.findall(doc.read_text()):
            for m in _IMPORT.finditer(block):
                top = (m.group(1) or m.group(2)).split(".")[0]
                if top in _OURS or top in sys.stdlib_module_names:
                    continue
                seen.add(top)
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                if not dists & allowed:
                    missing.setdefault(top, set()).add(doc.name)
    assert {"torch", "kernels"} <= seen, seen  # the snippets were found and read
    assert not missing, f"imported by docs snippets, not in the examples extra: {missing}"
