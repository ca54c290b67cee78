"""No import cycle among the project's modules (schemas/, brokers/, specsplit/), found statically.

Every ``.py`` file is parsed with ``ast``; every ``import`` and ``from ... import`` of a project
module counts, at module level and inside functions alike (an import deferred into a function
still ties the two modules together, and only hides the cycle until that function runs). Relative
imports are resolved against the importing module; ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. Imports under ``if TYPE_CHECKING:`` never run
and do not count.

Package mechanics. Importing ``a.b.c`` first runs ``a/__init__`` and ``a/b/__init__``, so the
import is an edge to ``a.b.c`` and to each of those packages too, except the packages the
importer itself lives in: they are always initialised (or being initialised) before any of their
submodules runs, so a submodule never makes its own package start. That keeps the usual pattern
legal, a package's ``__init__`` re-exporting its submodules (an edge ``pkg -> pkg.sub``, counted)
while ``pkg.sub`` imports ``pkg.other`` (no edge back to ``pkg``). A cycle is any strongly
connected component with more than one module, or a module importing itself.

    a.x: from a.y import f      edges a.x -> a.y             (a: a.x's own package, skipped)
    a.y: from b import g        edges a.y -> b
    b:   from a.x import h      edges b -> a.x, b -> a       -> cycle a.x -> a.y -> b -> a.x
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "brokers", "specsplit")


def project_modules() -> dict[str, Path]:
    """Every module under PACKAGES by dotted name: ``{"specsplit.cli": .../specsplit/cli.py}``."""
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and is_type_checking(node.test):
            children = node.orelse
        todo.extend(children)
    return out


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names ``node`` imports (modules, or ``module.attribute`` candidates)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        # the package the relative import starts from: the module itself when it is a package
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its imports run (package mechanics as the docstring says)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        for node in import_nodes(ast.parse(path.read_text(), str(path))):
            for name in imported_names(module, is_package, node):
                if name not in modules:
                    continue  # a third-party module, or ``pkg.attribute`` that is not a module
                parts = name.split(".")
                targets = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
                graph[module] |= {t for t in targets if t in modules and t not in own}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of ``graph`` that hold a cycle (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    out.append(sorted(component))
    return out


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """A component with the edges inside it, one module a line."""
    inside = set(component)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & inside))}" for m in component)


def test_the_project_has_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n\n".join(describe(c, graph) for c in found)


def test_the_checker_finds_a_cycle_and_resolves_imports() -> None:
    graph = {"a": {"a.x"}, "a.x": {"a.y"}, "a.y": {"b"}, "b": {"a", "a.x"}, "c": {"c"}, "d": set()}
    assert cycles(graph) == [["a", "a.x", "a.y", "b"], ["c"]]
    tree = ast.parse("from . import x\nfrom ..b import y\nimport c.d\n")
    nodes = sorted(import_nodes(tree), key=lambda n: n.lineno)
    assert imported_names("p.q.m", False, nodes[0]) == ["p.q", "p.q.x"]
    assert imported_names("p.q", True, nodes[0]) == ["p.q", "p.q.x"]
    assert imported_names("p.q.m", False, nodes[1]) == ["p.b", "p.b.y"]
    assert imported_names("p.q.m", False, nodes[2]) == ["c.d"]
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    assert [type(n) for n in import_nodes(hidden)] == [ast.ImportFrom]


def test_the_graph_follows_the_rule_of_its_docstring() -> None:
    graph = import_graph()
    assert "specsplit.bench.longctx" in graph["specsplit.cli"]  # imported inside a function
    assert "specsplit.models.settings" in graph["specsplit.models"]  # a package re-exporting a submodule
    assert "specsplit.models" not in graph["specsplit.models.settings"]  # its own package: skipped
    assert {"specsplit.models", "specsplit.models.settings"} <= graph["specsplit.effective"]  # a package on the way
