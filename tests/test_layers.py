"""The import graph: no module imports itself through others, and each layer imports only
the layers beneath it (read from the source with ast, so nothing is imported here)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "reports", "scenarios", "models", "devices", "server", "emulator")
# what each layer may import besides itself (devices and the server never import each other:
# they meet only on the wire)
ALLOWED = {
    "common": set(),
    "reports": {"common"},
    "scenarios": {"common"},
    "models": {"common"},
    "devices": {"common", "scenarios", "models"},
    "server": {"common", "scenarios", "models", "reports"},
    "emulator": {"common", "scenarios", "models", "reports", "devices", "server"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = ".".join(("flt", *path.relative_to(REPO).with_suffix("").parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Imported module names, leaving out `if TYPE_CHECKING:` blocks (never run)."""
    names: list[str] = []
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


@functools.cache  # read once for all the tests here
def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _runtime_imports(ast.parse(p.read_text())) if n in mods} - {m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "flt.common.wire" in graph["flt.server.transport"]  # the check below has edges to check


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", PACKAGES)
def test_layers_import_only_what_lies_beneath(layer):
    wrong = sorted(
        f"{m} imports {n}"
        for m, deps in import_graph().items()
        if m.split(".")[1] == layer
        for n in deps
        if n.split(".")[1] not in ALLOWED[layer] | {layer}
    )
    assert not wrong, wrong
