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


def _unannotated(path: Path, root: Path = REPO) -> list[str]:
    """Public functions of `path` with a parameter (self and cls aside) or a return left unannotated."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        a = node.args
        params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
        params += [p for p in (a.vararg, a.kwarg) if p is not None]
        if node.returns is None or any(p.annotation is None for p in params):
            out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return out


def test_unannotated_functions_are_found(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def typed(x: int, *a: int, **k: str) -> int: ...\n"
        "def _private(x): ...\n"
        "def no_return(x: int): ...\n"
        "class C:\n    def method(self, y) -> None: ...\n"
    )
    assert [f.rsplit(" ", 1)[1] for f in _unannotated(sample, tmp_path)] == ["no_return", "method"]


def test_every_public_function_is_typed():
    """mypy checks every body (check_untyped_defs); a public function's signature says what it takes."""
    missing = [f for path in sorted(_modules().values()) for f in _unannotated(path)]
    assert not missing, missing
