"""No Python module of the project (code, tests, scripts) is over 400 lines: a module that grows past that is split
by responsibility (docs/design.md §1)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
FOLDERS = ("hearth", "scripts", "tests")


def oversized(root: Path, folders: tuple[str, ...] = FOLDERS, max_lines: int = MAX_LINES) -> list[str]:
    """`path: N lines` for each .py under `folders` longer than `max_lines`."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > max_lines:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_module_is_over_400_lines():
    assert not oversized(ROOT), f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(oversized(ROOT))


def test_the_check_finds_a_long_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 5)
    assert oversized(tmp_path, ("pkg",), max_lines=4) == ["pkg/long.py: 5 lines"]
