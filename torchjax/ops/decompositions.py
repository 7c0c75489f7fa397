"""The decompositions torchjax runs, named one by one.

Note [An explicit decomposition list]
An ATen overload without a lowering of its own (and without a functional sibling that
has one, for in-place and ``out=`` overloads) runs torch's Python decomposition from
``torch._decomp``'s table. Which overloads do is data, decompositions.txt next to this
module, not "whatever the table holds": a torch upgrade that adds a decomposition would
otherwise change silently how an op runs (from CompositeImplicitAutograd's kernel, or a
missing-lowering error, to the new decomposition), and one that drops a decomposition
would turn a working op into an error. tests/ops/test_decompositions.py compares the
list with the installed torch's table and with the lowerings, and names every overload
torch added or removed: add it to the list (or lower it), or take it out.
"""

from __future__ import annotations

import pathlib

from torchjax._compat.torch import decomposition_table


def _read(path: pathlib.Path) -> frozenset[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line and not line.startswith("#"))


LISTED: frozenset[str] = _read(pathlib.Path(__file__).with_name("decompositions.txt"))


def get(func):
    """``func``'s decomposition from torch's table if the list names it, else None."""
    return decomposition_table.get(func) if str(func) in LISTED else None


def has(func) -> bool:
    return str(func) in LISTED and func in decomposition_table
