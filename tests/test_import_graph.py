"""The runtime's imports form no cycle: every module can be read after the ones it names.

Read from the source (every `import` and `from ... import`, those under TYPE_CHECKING and
inside functions too), so a cycle hidden from the interpreter by a lazy or type-only import
still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.runtime_tree import runtime_modules


def imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The runtime modules one module's source names: `from a import b` is a.b where b is
    a module, else a."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in modules else node.module)
    return {name for name in names if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = runtime_modules()
    return {name: imported(ast.parse(path.read_text()), modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, or one that imports
    itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_runtime_module_sits_in_an_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the walk found too few modules to mean anything"
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_type_only_import() -> None:
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from prefix_sidecar.b import B
"""
    modules = {"prefix_sidecar.a": Path("a.py"), "prefix_sidecar.b": Path("b.py")}
    graph = {
        "prefix_sidecar.a": imported(ast.parse(source), modules),
        "prefix_sidecar.b": imported(ast.parse("import prefix_sidecar.a\n"), modules),
    }
    assert cycles(graph) == [["prefix_sidecar.a", "prefix_sidecar.b"]]
