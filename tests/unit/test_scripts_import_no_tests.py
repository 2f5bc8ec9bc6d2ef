"""Scripts are tools a user runs from a checkout or an installed tree: they import nothing from tests/ (a shared
helper lives in the product or in a module of scripts/)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_collector_sees_every_kind_of_import_of_tests() -> None:
    """The collector sees plain, from- and deferred imports of tests."""
    source = "import tests.unit.x\ndef f():\n    from tests.e2e import y\nfrom services import z\nimport testsuite\n"
    assert imported_tests(ast.parse(source)) == ["tests.unit.x", "tests.e2e"]


def imported_tests(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found.extend(name for name in names if name == "tests" or name.startswith("tests."))
    return found


def test_no_script_imports_from_tests():
    offenders = {path.relative_to(ROOT).as_posix(): imported
                 for path in sorted((ROOT / "scripts").rglob("*.py"))
                 if (imported := imported_tests(ast.parse(path.read_text(encoding="utf-8"))))}
    assert not offenders, offenders
