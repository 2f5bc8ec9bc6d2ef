"""The configuration reference (docs/configuration.md): every table and key of `HearthSettings` with its type,
default, bounds, unit and environment variable, and a complete example file."""

from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hearth.services.common import config
from hearth.services.common.config_aliases import old_names_note
from hearth.services.schema import COMMAND, qualified_name

# Suffixes of key names and the unit they mean; the longest that matches wins.
UNIT_SUFFIXES = (
    ("_seconds", "seconds"),
    ("_chunks", "chunks"),
    ("_bytes", "bytes"),
    ("_ms", "milliseconds"),
    ("_mb", "MiB"),
    ("_days", "days"),
    ("_s", "seconds"),
)
# Defaults computed from the environment when the settings are built: what they fall back to, and the variable.
ENVIRONMENT_DEFAULTS: dict[Callable[[], Any], tuple[Any, str]] = {
    config.default_nats_url: (config.DEFAULT_NATS_URL, config.NATS_URL_ENV),
}
# The bounds pydantic keeps in a field's metadata (Gt, Ge, Lt, Le, MinLen, MaxLen objects), by attribute name.
_CONSTRAINTS = (
    ("gt", ">"),
    ("ge", ">="),
    ("lt", "<"),
    ("le", "<="),
    ("min_length", "length >="),
    ("max_length", "length <="),
)
_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string"}


@dataclass(frozen=True)
class Section:
    """One TOML table of the settings: its path from the root (empty for top-level keys) and its model."""

    path: tuple[str, ...]
    model: type[BaseModel]

    @property
    def table(self) -> str:
        return ".".join(self.path)

    def keys(self) -> list[tuple[str, FieldInfo]]:
        return [(name, field) for name, field in self.model.model_fields.items() if _section_model(field) is None]

    def summary(self) -> str:
        """The model's docstring on one line, without its leading `[table]: `."""
        doc = inspect.cleandoc(self.model.__dict__.get("__doc__") or "")
        return re.sub(r"^\[[^\]]*\]:\s*", "", " ".join(doc.split()))


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def settings_sections(model: type[BaseModel] | None = None, path: tuple[str, ...] = ()) -> list[Section]:
    """Every table of `HearthSettings` that has keys of its own, a table before the tables nested in it."""
    model = model or config.HearthSettings
    section = Section(path, model)
    sections = [section] if section.keys() else []
    for name, field in model.model_fields.items():
        nested = _section_model(field)
        if nested is not None:
            sections += settings_sections(nested, (*path, name))
    return sections


def environment_variable(path: tuple[str, ...]) -> str:
    return (config.ENV_PREFIX + config.ENV_NESTED_DELIMITER.join(path)).upper()


def unit_of(key: str) -> str | None:
    return next((unit for suffix, unit in UNIT_SUFFIXES if key.endswith(suffix)), None)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML spelling for the default {value!r}")


def default_of(field: FieldInfo, where: str) -> tuple[Any, str | None]:
    """A key's default and, when the environment supplies it, the variable it is read from."""
    if field.default_factory is not None:
        if field.default_factory not in ENVIRONMENT_DEFAULTS:
            raise ValueError(f"{where}: add its default_factory to services.schema.configuration.ENVIRONMENT_DEFAULTS")
        return ENVIRONMENT_DEFAULTS[field.default_factory]
    if field.is_required():
        raise ValueError(f"{where} has no default, so no example file can leave it out")
    return field.default, None


def type_name(annotation: Any) -> str:
    options = typing.get_args(annotation)
    if type(None) in options and len(options) == 2:  # `X | None`: an optional X
        return type_name(next(option for option in options if option is not type(None))) + " (optional)"
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{toml_value(choice)}`" for choice in typing.get_args(annotation))
    return _TOML_TYPES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def constraint_of(field: FieldInfo) -> str:
    parts = [
        f"{symbol} {getattr(item, attribute)}"
        for item in field.metadata
        for attribute, symbol in _CONSTRAINTS
        if getattr(item, attribute, None) is not None
    ]
    return ", ".join(parts)


def _default_cell(field: FieldInfo, key: str, where: str) -> str:
    value, variable = default_of(field, where)
    cell = "unset" if value is None else f"`{toml_value(value)}`"
    if variable is not None:
        cell += f" (or `${variable}`)"
    if unit_of(key) == "bytes" and isinstance(value, int) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
        cell += f" ({value // (1024 * 1024)} MiB)"
    return cell


def _cell(text: str) -> str:
    return (text or "—").replace("|", "\\|")


def example_toml() -> str:
    """A complete configuration file: every table, every key at its default."""
    lines = []
    for section in settings_sections():
        if lines:
            lines.append("")
        if section.path:
            lines.append(f"[{section.table}]")
        for key, field in section.keys():
            default = default_of(field, f"{section.table}.{key}")[0]
            # TOML has no null: a key that is unset by default is shown commented out.
            lines.append(f'# {key} = ""' if default is None else f"{key} = {toml_value(default)}")
    return "\n".join(lines) + "\n"


def _module_paragraphs(module: Any) -> list[str]:
    """A module docstring's paragraphs, each on one line."""
    doc = inspect.cleandoc(module.__doc__ or "")
    return [" ".join(paragraph.split()) for paragraph in doc.split("\n\n") if paragraph.strip()]


def configuration_page() -> str:
    settings = config.HearthSettings
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from {qualified_name(settings)} ({config.__name__}); "
        "edit the models, not this page. -->",
        "",
    ]
    for paragraph in _module_paragraphs(config):
        lines += [paragraph, ""]
    lines += [
        "Each key below is listed with its type, default, allowed range, unit and the environment variable "
        "that overrides it.",
        "",
        "## A complete file",
        "",
        "Every table and every key, at its default:",
        "",
        "```toml",
        example_toml().rstrip("\n"),
        "```",
        "",
        "## Keys",
    ]
    for section in settings_sections():
        summary = section.summary()
        lines += ["", f"### `[{section.table}]`" if section.path else "### Top level", ""]
        if summary:
            lines += [summary[:1].upper() + summary[1:], ""]
        lines += [
            "| key | type | default | constraint | unit | environment variable | description |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for key, field in section.keys():
            where = ".".join((*section.path, key))
            cells = [
                f"`{key}`",
                type_name(field.annotation),
                _default_cell(field, key, where),
                constraint_of(field),
                unit_of(key) or "",
                f"`{environment_variable((*section.path, key))}`",
                (field.description or summary) + old_names_note((*section.path, key), environment_variable),
            ]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"
