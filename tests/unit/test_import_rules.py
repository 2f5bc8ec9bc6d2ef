"""The dependency rules of docs/design.md §1, enforced: forbidden imports, no torch in the light processes,
no import cycles.

Three checks, each failing with the offending module and import:

- statically, every import statement (module level, inside functions, under TYPE_CHECKING) of every
  ``.py`` under inference/, events/, readmodels/ and services/ against the table of §1;
- at runtime, in a fresh interpreter, importing every module of the light packages (events, readmodels,
  services/common, services/projector, services/replay, and services/cli.py) leaves torch and
  transformers out of ``sys.modules``;
- the graph of module-level imports among the project's modules has no cycle (imports inside functions
  and under ``if TYPE_CHECKING:`` run later or never, so they do not count).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inference", "events", "readmodels", "services", "trust")
HEAVY_MODULES = ("torch", "transformers")


@dataclass(frozen=True)
class Rule:
    """Modules under `importer` must never import anything under `forbidden`, except what is under `allowed`."""

    importer: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()

    def breaks(self, target: str) -> str | None:
        """The forbidden package `target` falls under, or None."""
        if any(under(target, package) for package in self.allowed):
            return None
        return next((package for package in self.forbidden if under(target, package)), None)


RULES = (
    Rule("trust", ("inference", "events", "readmodels", "services", "torch", "nats")),
    Rule("inference", ("nats", "events", "readmodels", "services")),
    Rule("events", ("inference", "readmodels", "services", "torch")),
    Rule("readmodels", ("inference", "services", "torch")),
    Rule("services.transport", ("inference", "readmodels")),
    Rule("services.shard", ("services.orchestrator",)),
    Rule("services.orchestrator", ("services.shard",)),
    Rule("services.replay", ("inference", "torch")),
    Rule("services.projector", ("inference", "torch")),
    Rule("services.common", ("torch", "transformers", "inference", "services"), allowed=("services.common",)),
)

# Modules whose whole import must leave torch and transformers unloaded (they start fast, run where no model is).
LIGHT_PACKAGES = ("events", "readmodels", "services.common", "services.projector", "services.replay", "trust")
LIGHT_MODULES = ("services.cli",)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # the imported module, absolute
    top_level: bool  # runs when the importing module is imported


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
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
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
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


def test_the_scan_sees_the_project_and_its_deferred_imports():
    assert {"inference", "events", "readmodels", "services.common.config", "services.transport.frames"} <= set(MODULES)
    assert any(found.module == "services.cli" and not found.top_level for found in ALL_IMPORTS)


def test_the_collector_resolves_relative_imports_and_defers_functions_and_type_checking(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import frames\n"
        "from .errors import FrameError\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def later():\n    import inference.runner\n"
    )
    path = tmp_path / "module.py"
    path.write_text(source)
    found = {(item.target, item.top_level) for item in imports_of("services.transport.sender", path)}
    assert found == {
        ("typing", True),
        ("services.transport.frames", True),
        ("services.transport.errors", True),
        ("torch", False),
        ("inference.runner", False),
    }


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.importer)
def test_no_module_imports_what_its_package_must_never_import(rule: Rule):
    offences = []
    for found in ALL_IMPORTS:
        if not under(found.module, rule.importer):
            continue
        package = rule.breaks(found.target)
        if package is not None:
            where = found.path.relative_to(ROOT)
            when = "" if found.top_level else " (deferred)"
            offences.append(f"{where}:{found.line}: {found.module} imports {found.target}{when}")
    never = ", ".join(rule.forbidden) + (f" (except {', '.join(rule.allowed)})" if rule.allowed else "")
    assert not offences, f"{rule.importer} must never import {never}:\n" + "\n".join(offences)


_PROBE = r"""
import importlib, json, sys, traceback

heavy = tuple(sys.argv[1].split(","))
packages = tuple(sys.argv[2].split(","))
modules = sys.argv[3:]
chains = []


class Watch:
    # Notes which project code asked for a heavy module the first time; never finds anything itself.
    def find_spec(self, fullname, path=None, target=None):
        if fullname in heavy and not chains:
            chain = []
            frame = sys._getframe(1)
            while frame is not None:
                name = frame.f_globals.get("__name__", "")
                if name.split(".")[0] in packages:
                    code = frame.f_code.co_name
                    chain.append(name if code == "<module>" else f"{name}.{code}()")
                frame = frame.f_back
            chains.append(list(reversed(chain)))
        return None


sys.meta_path.insert(0, Watch())
for index, module in enumerate(modules):
    chains.clear()
    try:
        importlib.import_module(module)
    except BaseException as error:
        print(json.dumps({"index": index, "error": "".join(traceback.format_exception_only(error)).strip()}))
        sys.exit(0)
    loaded = [name for name in heavy if name in sys.modules]
    if loaded:
        print(json.dumps({"index": index, "loaded": loaded, "chain": chains[0] if chains else []}))
        sys.exit(0)
print(json.dumps({"index": len(modules)}))
"""


def light_modules() -> list[str]:
    return [
        module
        for module in MODULES
        if any(under(module, package) for package in LIGHT_PACKAGES) or module in LIGHT_MODULES
    ]


def test_the_light_processes_never_load_torch_or_transformers():
    """One interpreter imports the light modules in turn; one that loads a heavy module is reported with the chain
    of project modules that led there, and the rest are checked in a fresh interpreter."""
    modules = light_modules()
    assert "services.projector.main" in modules and "services.replay.cli" in modules
    offences = []
    start = 0
    while start < len(modules):
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, ",".join(HEAVY_MODULES), ",".join(PACKAGES), *modules[start:]],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        index = start + report["index"]
        if index >= len(modules):
            break
        if "error" in report:
            offences.append(f"import {modules[index]} failed, so it could not be checked: {report['error']}")
        else:
            chain = " -> ".join(report["chain"]) or modules[index]
            offences.append(f"import {modules[index]} loads {', '.join(report['loaded'])} (via {chain})")
        start = index + 1
    assert not offences, "\n".join(offences)


def import_graph() -> dict[str, set[str]]:
    """Module-level imports among the project's own modules."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for found in ALL_IMPORTS:
        if found.top_level and found.target in MODULES and found.target != found.module:
            graph[found.module].add(found.target)
    return graph


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


def test_the_cycle_finder_reports_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycles = [component for component in strongly_connected(graph) if len(component) > 1]
    assert cycles == [["a", "b", "c"]]
    assert shortest_cycle(graph, cycles[0]) == ["a", "b", "c", "a"]


def test_no_import_cycles_at_module_level():
    graph = import_graph()
    cycles = [
        " -> ".join(shortest_cycle(graph, component))
        for component in strongly_connected(graph)
        if len(component) > 1
    ]
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)
