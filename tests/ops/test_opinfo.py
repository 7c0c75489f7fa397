"""The test of record: every op_db entry (torch's OpInfo database) on "tpu" vs CPU torch.

Family files (tests/ops/test_<family>.py) test the entries named in their module-level
``*OPS = [...]`` lists (``OPS``, ``FACTORY_OPS``, ...); this file tests every other entry
through the same machinery (tests/ops/opinfo_cases.py), so each entry is tested exactly
once and a new family file takes its entries out of here by naming them. The lists are read
statically with ``ast`` (no import of the family files), so collection order and
pytest-xdist workers agree. Failing cases are strict xfails listed in
tests/ops/expected_failures.csv; random ops go through ``torchjax.testing.checks.check_random``.
"""

from __future__ import annotations

import ast
import pathlib

from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi

_HERE = pathlib.Path(__file__).parent


def _string_list(node) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _string_list(node.left) + _string_list(node.right)
    return []


def claimed_names(directory: pathlib.Path = _HERE) -> dict[str, str]:
    """OpInfo name -> family test file, from the ``*OPS`` lists of tests/ops/test_*.py."""
    claimed = {}
    for path in sorted(directory.glob("test_*.py")):
        if path.name == pathlib.Path(__file__).name:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id.endswith("OPS") for t in targets):
                    for name in _string_list(node.value):
                        claimed.setdefault(name, path.name)
    return claimed


def unclaimed_names() -> list[str]:
    claimed = {id(o) for o in oi.opinfos(claimed_names())}
    return [oi.full_name(o) for o in oi.reference_entries() if id(o) not in claimed]


OPS = unclaimed_names()
globals().update(make_tests(OPS))


def test_every_claimed_name_is_an_opinfo():
    """A typo in a family's list would silently move nothing out of here."""
    known = {oi.full_name(o) for o in oi.opinfos(claimed_names())} | {
        o.name for o in oi.opinfos(claimed_names())
    }
    assert {n: f for n, f in claimed_names().items() if n not in known} == {}
