"""The package's imports point down its layers (docs/architecture.md), with no circle.

Every import in torchjax/, at module level or inside a function, is read from the source.
A module may import its own package and the packages of lower layers; a package never
imports one of its own layer or above, so no two packages can import each other. Module
level imports of the whole package form no cycle either (a function-level import inside
one package, such as a module of tensor/ that builds the class defined next to it, is
the one kind of back edge allowed, and only within a package).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchjax"

# Bottom to top; one row is one layer (docs/architecture.md draws the same table).
LAYERS = [
    ("torchjax._patches",),
    ("torchjax._compat",),
    ("torchjax._budget", "torchjax._compilation_cache"),
    ("torchjax.tensor",),
    ("torchjax.device",),
    ("torchjax.ops",),
    ("torchjax.checkpoint", "torchjax.interop"),
    ("torchjax.sharding", "torchjax.compile", "torchjax.pallas"),
    ("torchjax.integrations",),
    ("torchjax",),
    ("torchjax.testing",),
]
RANK = {unit: n for n, row in enumerate(LAYERS) for unit in row}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _unit(module: str) -> str:
    """The layer table's unit of ``module``: its first-level package or module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _imports(module: str, path: pathlib.Path, mods) -> list[tuple[str, int, bool]]:
    """(imported torchjax module, line, at module level) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("tests", "tools"):
                found.append((name, node.lineno, id(node) in top))
                continue
            while name not in mods and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in mods and name != module and not module.startswith(name + "."):
                found.append((name, node.lineno, id(node) in top))
    return found


MODULES = _modules()
EDGES = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units, "no modules found"
    assert sorted(units - RANK.keys()) == []


def test_imports_point_down_the_layers():
    upward = []
    checked = 0
    for module, edges in EDGES.items():
        for target, line, _ in edges:
            checked += 1
            src, dst = _unit(module), _unit(target)
            if src == dst:
                continue
            if dst not in RANK or RANK[dst] >= RANK[src]:
                upward.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line} imports {target}")
    assert checked > 300
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_at_module_level():
    graph = {m: {t for t, _, top in edges if top} for m, edges in EDGES.items()}
    assert _cycles(graph) == []


def test_back_edges_stay_inside_a_package():
    graph = {m: {t for t, _, _ in edges} for m, edges in EDGES.items()}
    crossing = [c for c in _cycles(graph) if len({m.rsplit(".", 1)[0] for m in c}) > 1]
    assert crossing == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected
