"""The old places of configuration keys that moved: each old TOML path (and so its `HEARTH_*` variable) still sets
the key at its new place, and giving a key at both places is an error rather than a silent pick.

hearth/services/common/config.py moves the keys of the environment and of the TOML file each on its own
(`KeysMovedSource`), so that a key's new name in the environment still wins over its old name in the file, then
those of the merged settings (keyword arguments included) before validating them; `hearth schema` lists each key's
old names beside it in docs/configuration.md (`old_names_note`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource


ConfigPath = tuple[str, ...]

_HOST = ("research", "distributed_inference", "host")
_DISTRIBUTED = ("research", "distributed_inference")

# (old path, new path) from the settings root. A shard's own settings moved from
# [research.distributed_inference.host] (the specification's table) into [shard], without their `shard_` prefix;
# `_seconds` names became `_s` like every other duration.
MOVED_KEYS: tuple[tuple[ConfigPath, ConfigPath], ...] = (
    ((*_HOST, "serve_shards"), ("shard", "serve_shards")),
    ((*_HOST, "shard_eviction_idle_seconds"), ("shard", "eviction_idle_s")),
    ((*_HOST, "shard_eviction_idle_s"), ("shard", "eviction_idle_s")),
    ((*_HOST, "shard_max_memory_mb"), ("shard", "max_memory_mb")),
    ((*_HOST, "shard_max_vram_mb"), ("shard", "max_memory_mb")),
    ((*_HOST, "kv_cache_budget_mb"), ("shard", "kv_cache_budget_mb")),
    ((*_HOST, "cuda_graph_max_tokens"), ("shard", "cuda_graph_max_tokens")),
    ((*_HOST, "cpu_linear_kernel"), ("shard", "cpu_linear_kernel")),
    ((*_DISTRIBUTED, "shard_health_timeout_seconds"), (*_DISTRIBUTED, "shard_health_timeout_s")),
)


def dotted(path: ConfigPath) -> str:
    """A key's path as a TOML file spells it: `[table.sub] key`, or the bare key at the top level."""
    return f"[{'.'.join(path[:-1])}] {path[-1]}" if len(path) > 1 else path[0]


def old_names_of(path: ConfigPath) -> list[ConfigPath]:
    """The old paths that still set the key at `path`, in MOVED_KEYS order."""
    return [old for old, new in MOVED_KEYS if new == path]


def old_names_note(path: ConfigPath, variable_of: Callable[[ConfigPath], str]) -> str:
    """What docs/configuration.md adds to the description of the key at `path`: its old places, each with its
    environment variable (`variable_of`), or nothing for a key that never moved."""
    old = old_names_of(path)
    if not old:
        return ""
    return "; old names, still accepted: " + ", ".join(f"`{dotted(name)}` (`{variable_of(name)}`)" for name in old)


def move_aliased_keys(data: Any, *, refuse_both: bool = True) -> Any:
    """`data` (the settings as the sources give them) with every key found at an old path moved to its new one.

    A key given at its old and its new path (or at two old ones) raises ValueError naming both paths, or with
    `refuse_both` false stays at both places, for the validation of the merged sources to refuse.
    """
    if not isinstance(data, dict):
        return data
    moved = _copied_tables(data)
    for old, new in MOVED_KEYS:
        if not _contains(moved, old):
            continue
        if _contains(moved, new):
            if not refuse_both:
                continue
            raise ValueError(f"{dotted(old)} is an old name of {dotted(new)}, which is given already (by that name "
                             f"or another old one): give it once, as {dotted(new)}")
        _put(moved, new, _pop(moved, old))
    return moved


def _copied_tables(data: dict) -> dict:
    """A copy of the nested tables, so that moving keys never changes the caller's dictionaries."""
    return {key: _copied_tables(value) if isinstance(value, dict) else value for key, value in data.items()}


class KeysMovedSource(PydanticBaseSettingsSource):
    """A settings source whose keys at an old place are moved to their new one before the sources are merged."""

    def __init__(self, inner: PydanticBaseSettingsSource) -> None:
        super().__init__(inner.settings_cls)
        self._inner = inner

    def _set_current_state(self, state: dict[str, Any]) -> None:
        super()._set_current_state(state)
        self._inner._set_current_state(state)

    def _set_settings_sources_data(self, states: dict[str, dict[str, Any]]) -> None:
        super()._set_settings_sources_data(states)
        self._inner._set_settings_sources_data(states)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        # A raise here would escape pydantic's ValidationError; the merged sources' validation refuses instead.
        return move_aliased_keys(self._inner(), refuse_both=False)

    def __repr__(self) -> str:
        return f"KeysMovedSource({self._inner!r})"


def _child(table: dict | BaseModel | None, name: str) -> Any:
    if isinstance(table, dict):
        return table.get(name)
    if isinstance(table, BaseModel) and name in table.model_fields_set:
        return getattr(table, name)
    return None


def _pop(data: dict, path: ConfigPath) -> Any:
    table: Any = data
    for name in path[:-1]:
        table = _child(table, name)
    return table.pop(path[-1])


def _contains(data: dict, path: ConfigPath) -> bool:
    """Whether `path` is given; an old path never is in a section given as a model (it has no such field)."""
    table: Any = data
    for name in path[:-1]:
        table = _child(table, name)
    return (isinstance(table, dict) and path[-1] in table) or (
        isinstance(table, BaseModel) and path[-1] in table.model_fields_set)


def _put(data: dict, path: ConfigPath, value: Any) -> None:
    """Set the key at `path`, making the tables on the way; a section given as a model becomes the table of the keys
    it was given."""
    table = data
    for name in path[:-1]:
        child = table.get(name)
        if isinstance(child, BaseModel):
            child = child.model_dump(exclude_unset=True)
        elif child is None:
            child = {}
        if not isinstance(child, dict):
            raise ValueError(f"{dotted(path)}: {name} is not a table")
        table[name] = child
        table = child
    table[path[-1]] = value
