"""The package's modules import each other without cycles, counting imports inside functions
(a function-local import that dodges a cycle is still a cycle). Imports under
``if TYPE_CHECKING:`` never run and are left out; imports of optional extras (torch, numpy,
pyarrow...) are outside the package and so never part of a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "infinibatch_like"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules (and packages) it imports."""
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [alias.name for alias in node.names]
                names: list[str] = []
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = node.module or ""
                full = f"{base}.{module}".strip(".") if node.level else module
                bases, names = [full], [alias.name for alias in node.names]
            for base in bases:
                submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in paths]
                if submodules:
                    targets.update(submodules)
                if (len(submodules) < len(names) or not names) and base in paths:
                    targets.add(base)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_sees_relative_function_local_and_submodule_imports() -> None:
    graph = import_graph()
    # `_core.notes` (module level, relative) and `distributed.ranks` (inside a function of
    # `distributed.sharded`) are imports the checker must see.
    assert f"{PACKAGE}._core.protocol" in graph[f"{PACKAGE}._core.stage"]
    assert f"{PACKAGE}.distributed.ranks" in graph[f"{PACKAGE}.distributed.sharded"]
    assert f"{PACKAGE}.stages" in graph[PACKAGE] or any(
        target.startswith(f"{PACKAGE}.stages.") for target in graph[PACKAGE]
    )


def test_the_cycle_finder_reports_every_module_of_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles between modules:\n" + "\n".join(
        " <-> ".join(component) for component in found
    )
