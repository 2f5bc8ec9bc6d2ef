"""One home per default: a literal default written in two places drifts, so each concept's default lives in one place.

The collector reads (ast) every ``.py`` under the product packages and gathers, keyed by name (the concept), every
literal number or string given as a default (a name in SYNONYMS counts as its concept's name):

- a function's or method's keyword default (``def f(timeout_s=5.0)``, typer options included);
- a class field's default (dataclass and pydantic: ``x: int = 5``, ``Field(default=5)``, ``Field(5, ...)``);
- a module-level constant (``UPPER`` or ``lower``) assigned a literal or an arithmetic of literals (``1024 * 1024``).

Left out as no default: 0 and "" (a neutral start, not a choice), booleans, and a field whose annotation is the
``Literal`` of its own value (a discriminator tag such as ``type: Literal["x"] = "x"``). A name defaulted in two or
more places fails, naming every place, unless it is in GENERIC_NAMES (a shared name that is no shared concept) or
MIRRORS (a value the import rules forbid sharing, checked equal here instead).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tuple(f"hearth/{name}"
                 for name in ("formats", "inference", "events", "protocol", "readmodels", "services", "trust"))

# Names shared by unrelated things; each with why its defaults are not one concept.
GENERIC_NAMES = {
    "name": "a process, connection or batcher's own label",
    "kind": "a discriminator of unrelated types (step kinds, dashboard panels, quantization schemes)",
    "port": "the port of unrelated servers (the gateway's HTTP, nats-server's client port)",
    "COMMAND": "each CLI module's own command name",
    "max_header_bytes": "the gateway's HTTP request head and an activation frame's NATS headers",
    # "none" is the wire label of the unquantized scheme (hearth/events/models.py, docs/events.md), a protocol token
    # whose spelling cannot change without a wire change, not a tunable default.
    "quantization": "the wire label of the unquantized scheme",
}

# Names that spell one concept another way (another unit, another reader's word) -> the concept's name in the
# configuration: a default written under two of them is two homes, as if written under one name twice.
SYNONYMS = {
    "cache_budget_bytes": "kv_cache_budget_mb",
    "DEFAULT_CACHE_BUDGET_BYTES": "kv_cache_budget_mb",
    "kv_cache_budget_bytes": "kv_cache_budget_mb",
    "session_ttl_s": "eviction_idle_s",
    "DEFAULT_SESSION_TTL_S": "eviction_idle_s",
    "shard_eviction_idle_s": "eviction_idle_s",
    "shard_eviction_idle_seconds": "eviction_idle_s",
    "shard_max_memory_mb": "max_memory_mb",
    "DEFAULT_CPU_LINEAR_KERNEL": "cpu_linear_kernel",
}

# Values the package rules of tests/unit/test_import_rules.py forbid importing from one home (inference imports
# neither events nor services; the light processes never import inference, which brings torch): each pair of
# (file, name) places must hold equal values, checked below, and counts as one home.
MIRRORS = (
    (("hearth/inference/devices.py", "MiB"), ("hearth/events/streams.py", "MiB")),
    (("hearth/inference/sampling.py", "DEFAULT_MAX_TOKENS"), ("hearth/protocol/chat.py", "default_max_tokens")),
    (("hearth/inference/sampling.py", "top_p"), ("hearth/protocol/chat.py", "top_p")),
    (("hearth/inference/sampling.py", "repetition_penalty"), ("hearth/protocol/chat.py", "repetition_penalty")),
    (("hearth/inference/cpu_kernels.py", "DEFAULT_CPU_LINEAR_KERNEL"),
     ("hearth/services/common/config_processes.py", "cpu_linear_kernel")),
    (("hearth/inference/quantization.py", "AUTO_QUANTIZATION"),
     ("hearth/protocol/quantization_labels.py", "AUTO_QUANTIZATION")),
)

@dataclass(frozen=True)
class Default:
    name: str
    path: str  # relative to the scanned root
    line: int
    value: object

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} = {self.value!r}"


def literal_value(node: ast.AST) -> object | None:
    """The number or string `node` spells with literals only (arithmetic included), else None."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and all(
            literal_value(child) is not None for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)):
        try:
            return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})  # noqa: S307
        except ArithmeticError:
            return None
    return None


def is_default(value: object | None) -> bool:
    return value is not None and value not in (0, "")


def field_default(node: ast.expr) -> ast.expr | None:
    """The default expression of a class field's value: `Field(default=x)`, `Field(x, ...)`, `field(default=x)`."""
    if isinstance(node, ast.Call):
        function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if function not in ("Field", "field"):
            return None
        keyword = next((k.value for k in node.keywords if k.arg == "default"), None)
        return keyword if keyword is not None else (node.args[0] if node.args else None)
    return node


def is_tag(annotation: ast.expr) -> bool:
    return isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).endswith("Literal")


def defaults_in(tree: ast.Module, path: str) -> list[Default]:
    found: list[Default] = []

    def add(name: str, node: ast.expr | None, line: int) -> None:
        value = literal_value(node) if node is not None else None
        if is_default(value):
            found.append(Default(name, path, line, value))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            for argument, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults):
                add(argument.arg, default, default.lineno)
            for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
                if default is not None:
                    add(argument.arg, default, default.lineno)
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                        and statement.value is not None and not is_tag(statement.annotation)):
                    add(statement.target.id, field_default(statement.value), statement.lineno)
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name):
            add(statement.targets[0].id, statement.value, statement.lineno)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
                and statement.value is not None:
            add(statement.target.id, statement.value, statement.lineno)
    return found


def collect_defaults(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Default]:
    found: list[Default] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            found.extend(defaults_in(ast.parse(path.read_text(encoding="utf-8"), filename=relative), relative))
    return found


def mirrored() -> set[tuple[str, str]]:
    return {place for pair in MIRRORS for place in pair}


def duplicated(defaults: list[Default], *, generic: dict[str, str], skip: set[tuple[str, str]],
               synonyms: dict[str, str] | None = None) -> list[str]:
    """One line per concept (a name, or the concept `synonyms` maps it to) defaulted in two or more places, naming
    every place."""
    synonyms = SYNONYMS if synonyms is None else synonyms
    by_name: dict[str, list[Default]] = defaultdict(list)
    for default in defaults:
        if default.name not in generic and (default.path, default.name) not in skip:
            by_name[synonyms.get(default.name, default.name)].append(default)
    return [f"{name}: " + "; ".join(str(place) for place in places)
            for name, places in sorted(by_name.items()) if len(places) > 1]


def test_each_default_has_one_home():
    defaults = collect_defaults(ROOT)
    problems = duplicated(defaults, generic=GENERIC_NAMES, skip=mirrored())
    assert not problems, ("the same default is written in two places; give it one home (the config model, or one "
                          "module constant the others import):\n" + "\n".join(problems))


def test_mirrored_defaults_are_equal():
    values = {(default.path, default.name): default.value for default in collect_defaults(ROOT)}
    for first, second in MIRRORS:
        assert first in values and second in values, f"mirror {first} / {second}: one side holds no literal default"
        assert values[first] == values[second], f"{first} = {values[first]!r} but {second} = {values[second]!r}"


def test_allowances_name_places_that_exist():
    """An allowance left behind after its default moved would silently cover a new copy of it."""
    places = {(default.path, default.name) for default in collect_defaults(ROOT)}
    names = {name for _, name in places}
    assert not [name for name in GENERIC_NAMES if name not in names]


def test_a_concept_defaulted_under_two_of_its_names_fails(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "config.py").write_text("class Shard:\n    kv_cache_budget_mb: float = 1024\n"
                                       "    eviction_idle_s: float = 600\n")
    (package / "loading.py").write_text("DEFAULT_CACHE_BUDGET_BYTES = 1 << 30\n"
                                        "def load(*, session_ttl_s: float = 600.0): ...\n")
    defaults = collect_defaults(tmp_path, ("pkg",))
    problems = duplicated(defaults, generic={}, skip=set())
    assert [line.split(":", 1)[0] for line in problems] == ["eviction_idle_s", "kv_cache_budget_mb"]
    assert "pkg/loading.py:1 DEFAULT_CACHE_BUDGET_BYTES" in problems[1]
    assert not duplicated(defaults, generic={}, skip=set(), synonyms={})


def test_the_collector_finds_each_kind_of_default_and_names_both_places(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "from pydantic import BaseModel, Field\n"
        "MiB = 1024 * 1024\n"
        "retry_after_s = 5.0\n"
        "class Settings(BaseModel):\n"
        "    budget_mb: float = Field(default=1024, gt=0)\n"
        "    ttl_s: float = Field(600.0, gt=0)\n"
        "    kind: Literal['a'] = 'a'\n"
        "    start: int = 0\n"
        "def open_hop(*, max_tokens: int = 128, label: str = '') -> None: ...\n"
    )
    (package / "b.py").write_text(
        "from dataclasses import dataclass\n"
        "MiB = 2 ** 20\n"
        "@dataclass\n"
        "class Runner:\n"
        "    ttl_s: float = 300.0\n"
        "    kind: Literal['b'] = 'b'\n"
        "    start: int = 0\n"
        "def retry(retry_after_s=1.0, budget_mb=512, max_tokens=64, name='x'): ...\n"
        "def other(name='y', enabled=True): ...\n"
    )
    defaults = collect_defaults(tmp_path, ("pkg",))
    problems = duplicated(defaults, generic={"name": "generic"}, skip=set())
    assert [line.split(":", 1)[0] for line in problems] == ["MiB", "budget_mb", "max_tokens", "retry_after_s",
                                                            "ttl_s"]
    mib = next(line for line in problems if line.startswith("MiB"))
    assert "pkg/a.py:2" in mib and "pkg/b.py:2" in mib
    assert duplicated(defaults, generic={"name": "generic"}, skip={("pkg/b.py", "max_tokens")})[2].startswith(
        "retry_after_s")
    assert not duplicated(defaults[:1], generic={}, skip=set())
