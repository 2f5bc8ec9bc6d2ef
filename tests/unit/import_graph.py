"""The project's imports as tests/unit/test_import_rules.py checks them: every import statement of every module
(module level, inside functions, under TYPE_CHECKING), resolved to absolute names, and a cycle finder.

Names are read inside the `hearth` namespace: `services.cli` is hearth.services.cli (every package lives under
hearth/), which keeps the allow-list short."""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "hearth"
SOURCES = ROOT / NAMESPACE
PACKAGES = ("formats", "inference", "events", "protocol", "readmodels", "services", "trust")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # the imported module, absolute
    top_level: bool  # runs when the importing module is imported


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def within_namespace(name: str) -> str:
    """`hearth.services.cli` as `services.cli`; a name outside hearth as it is."""
    return name.removeprefix(NAMESPACE + ".") if name != NAMESPACE else ""


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCES).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((SOURCES / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


MODULES = project_modules()


class _ImportCollector(ast.NodeVisitor):
    """Every import of one module, resolved to absolute names, marked top-level or deferred."""

    def __init__(self, module: str, path: Path) -> None:
        self.module = module
        self.path = path
        self.is_package = path.name == "__init__.py"
        self.imports: list[Import] = []
        self._deferred = 0  # depth inside functions and TYPE_CHECKING blocks

    def _add(self, node: ast.stmt, target: str) -> None:
        self.imports.append(Import(self.module, self.path, node.lineno, target, self._deferred == 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, within_namespace(alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = within_namespace(node.module or "")
        for alias in node.names:
            submodule = f"{base}.{alias.name}" if base else alias.name
            self._add(node, submodule if submodule in MODULES else base)

    def _visit_deferred(self, node: ast.AST) -> None:
        self._deferred += 1
        self.generic_visit(node)
        self._deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_deferred

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        type_checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        if not type_checking:
            self.generic_visit(node)
            return
        self.visit(test)
        self._deferred += 1
        for statement in node.body:
            self.visit(statement)
        self._deferred -= 1
        for statement in node.orelse:
            self.visit(statement)


def imports_of(module: str, path: Path) -> list[Import]:
    collector = _ImportCollector(module, path)
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return collector.imports


ALL_IMPORTS = [found for module, path in MODULES.items() for found in imports_of(module, path)]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit to think about)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component."""
    start, members = component[0], set(component)
    parents: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node] & members):
            if successor == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if successor not in parents:
                parents[successor] = node
                queue.append(successor)
    raise AssertionError(f"{component} is not a cycle")
