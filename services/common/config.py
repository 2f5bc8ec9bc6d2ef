"""hearth's configuration (DESIGN.md §9): one TOML file, overridable by `HEARTH_*` environment variables.

Where the file comes from: `load_settings(path)`, else `$HEARTH_CONFIG`, else no file (defaults).
Precedence, highest first: keyword arguments to `load_settings`, environment variables, the TOML file,
the defaults below. Nested keys join with `__` under the `HEARTH_` prefix, e.g.
`HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__ALLOW_SELF_AS_SHARD=true` or `HEARTH_TRANSPORT__WINDOW_CHUNKS=32`.
Unknown keys in the file are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from services.common.nats_connection import default_nats_url

CONFIG_PATH_ENV = "HEARTH_CONFIG"
ENV_PREFIX = "HEARTH_"
ENV_NESTED_DELIMITER = "__"
MiB = 1024 * 1024


class ConfigError(ValueError):
    """The configuration file is missing or unreadable."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSettings(_Section):
    """[research.distributed_inference.host]: whether and how this machine serves shards."""

    serve_shards: bool = False
    shard_eviction_idle_seconds: float = Field(default=600, gt=0)
    shard_max_memory_mb: float = Field(default=20000, gt=0)


class DistributedInferenceSettings(_Section):
    """[research.distributed_inference]: routing, health and failover of sharded pipelines."""

    enabled: bool = True
    max_shards_per_request: int = Field(default=16, ge=1)
    shard_health_timeout_seconds: float = Field(default=30, gt=0)
    fallback_to_local: bool = True
    fallback_to_local_after_failures: int = Field(default=2, ge=0)
    activation_dtype: Literal["auto", "fp16", "fp32", "int8"] = "auto"
    allow_self_as_shard: bool = False
    max_concurrent_pipelines: int = Field(default=4, ge=1)
    host: HostSettings = HostSettings()


class ResearchSettings(_Section):
    """[research]: the experimental feature switch; false answers every request with experimental_disabled."""

    enable: bool = True
    distributed_inference: DistributedInferenceSettings = DistributedInferenceSettings()


class TransportSettings(_Section):
    """[transport]: the activation transport of DESIGN.md §6."""

    window_chunks: int = Field(default=16, ge=1, description="un-acked chunks in flight per hop")
    chunk_bytes: int = Field(default=1 * MiB, ge=1024, description="largest payload of one frame")
    step_timeout_s: float = Field(
        default=10.0, gt=0, description="a hop that has not passed a step on within this is stalled"
    )
    gone_check_after_s: float = Field(
        default=0.5, gt=0,
        description="a step held this long makes the orchestrator check that the hops holding it are still "
                    "connected (a dead host is failed over at once instead of after step_timeout_s)",
    )


class NatsSettings(_Section):
    """[nats]: where the broker is; `--nats` and `$HEARTH_NATS_URL` on the command line win over this."""

    url: str = Field(default_factory=default_nats_url)


class HearthSettings(BaseSettings):
    """Everything configurable in hearth; obtain it with `load_settings()`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        case_sensitive=False,
        extra="forbid",
        frozen=True,
    )

    research: ResearchSettings = ResearchSettings()
    transport: TransportSettings = TransportSettings()
    nats: NatsSettings = Field(default_factory=NatsSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = _toml_path_being_loaded.get()
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


# The file `load_settings` is reading; a context variable because pydantic-settings builds its sources
# in a classmethod that cannot receive per-call arguments.
_toml_path_being_loaded: ContextVar[Path | None] = ContextVar("hearth_toml_path", default=None)


def config_path_from_env() -> Path | None:
    value = os.environ.get(CONFIG_PATH_ENV, "").strip()
    return Path(value) if value else None


def load_settings(path: str | Path | None = None, **overrides: Any) -> HearthSettings:
    """Settings from the TOML file at `path` (or `$HEARTH_CONFIG`, or none), then env vars, then `overrides`.

    Raises ConfigError when a named file does not exist, pydantic.ValidationError when a value is invalid.
    """
    toml_path = Path(path) if path is not None else config_path_from_env()
    if toml_path is not None and not toml_path.is_file():
        raise ConfigError(f"configuration file {toml_path} does not exist")
    token = _toml_path_being_loaded.set(toml_path)
    try:
        return HearthSettings(**overrides)
    finally:
        _toml_path_being_loaded.reset(token)
