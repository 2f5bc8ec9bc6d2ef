"""The README's "One token's path, file by file" stays true and short: at most twelve numbered files, each one
existing, and every class or `Class.method` it names defined in the file its item names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 12
SECTION = "## One token's path, file by file"


def path_items(readme: str) -> list[str]:
    """The numbered items of the section, each with its continuation lines joined."""
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    items: list[str] = []
    for line in section.splitlines():
        if re.match(r"^\d+\. ", line):
            items.append(line)
        elif items and line.startswith("   "):
            items[-1] += " " + line.strip()
    return items


def defined_names(path: Path) -> set[str]:
    """Classes, functions and `Class.method` names defined in a module."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{member.name}" for member in node.body
                         if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def check_items(items: list[str], root: Path) -> list[str]:
    problems = []
    for item in items:
        path_text = re.search(r"`([\w/]+\.py)`", item)
        if path_text is None:
            problems.append(f"names no file: {item[:80]}")
            continue
        path = root / path_text.group(1)
        if not path.is_file():
            problems.append(f"{path_text.group(1)} does not exist")
            continue
        named = re.findall(r"`([A-Z]\w*(?:\.\w+)?)`", item.split(":", 1)[1] if ":" in item else item)
        first = named[:1]  # the item's subject; later names may live in the files it points to
        problems += [f"{path_text.group(1)} defines no {name}" for name in first if name not in defined_names(path)]
    return problems


def test_the_readme_token_path_names_at_most_twelve_files_that_define_what_it_says():
    items = path_items((ROOT / "README.md").read_text(encoding="utf-8"))
    assert 1 <= len(items) <= MAX_FILES, f"{len(items)} files in the token's path (at most {MAX_FILES})"
    assert not check_items(items, ROOT)


def test_the_check_reports_a_missing_file_and_an_undefined_class(tmp_path):
    (tmp_path / "real.py").write_text("class Here:\n    def run(self):\n        pass\n")
    items = ["1. `real.py`: `Here.run`, fine.", "2. `real.py`: `Gone`, renamed.", "3. `missing.py`: `Here`."]
    assert check_items(items, tmp_path) == ["real.py defines no Gone", "missing.py does not exist"]
