"""hearth's configuration (docs/configuration.md): one TOML file, overridable by `HEARTH_*` environment variables.

Where the file comes from: `load_settings(path)`, else `$HEARTH_CONFIG`, else no file (defaults).
Precedence, highest first: keyword arguments to `load_settings`, environment variables, the TOML file,
the defaults below. Nested keys join with `__` under the `HEARTH_` prefix, e.g.
`HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__ALLOW_SELF_AS_SHARD=true` or `HEARTH_TRANSPORT__WINDOW_CHUNKS=32`.
Unknown keys in the file are errors, so a typo never silently falls back to a default. An invalid configuration (a
value of the wrong type or range, an unknown key, a file that is not TOML) raises ConfigError, one line naming each
wrong setting by its environment variable or file key; every command refuses it with that line and exit code 2.

Keys that moved keep their old place as an alias (hearth/services/common/config_aliases.py): a shard's own settings
moved from `[research.distributed_inference.host]` into `[shard]`, and `_seconds` names became `_s`. Each key below
lists its old names; the old TOML path and its environment variable still work, and giving a key at both places is an
error.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from hearth.events.envelope import max_event_hops
from hearth.events.signing import DEFAULT_MAX_CLOCK_SKEW_S
from hearth.events.streams import MiB, pipelines_max_age_s, seconds_per_day, shards_max_age_s
from hearth.services.common.config_aliases import KeysMovedSource, move_aliased_keys
from hearth.services.common.config_errors import describe_invalid_configuration
from hearth.services.common.config_processes import (
    OrchestratorSettings,
    PrefixCacheSettings,
    ShardSettings,
    VerificationSettings,
)
from hearth.services.common.nats_urls import checked_nats_url
from hearth.services.common.config_sections import ClientSettings, ConfigSection, GatewaySettings, MetricsSettings
from hearth.protocol.bounds import max_int8_block_elems
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION, QUANTIZE_SETTING_PATTERN, check_runnable_setting


CONFIG_PATH_ENV = "HEARTH_CONFIG"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NATS_URL_ENV = "HEARTH_NATS_URL"
ENV_PREFIX = "HEARTH_"
ENV_NESTED_DELIMITER = "__"
# The smallest chunk a sender may cut a step into: receivers refuse a step that claims more chunks than its
# size needs at this chunk size (hearth/services/transport/limits.py).
smallest_chunk_bytes = 1024


def default_nats_url() -> str:
    return os.environ.get(NATS_URL_ENV, DEFAULT_NATS_URL)


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or not TOML, or a setting is invalid (one line says which)."""


class HostSettings(ConfigSection):
    """[research.distributed_inference.host]: where and how this machine computes (its shards, an orchestrator's
    head and local model), and how `hearth host` moves its shards; how one shard serves is under [shard]."""

    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", validation_alias=AliasChoices("device", "backend"),
        description="where this machine computes (shards, an orchestrator's head): auto (CUDA when torch sees "
                    "one), cpu, cuda, cuda:N (`backend` is accepted as its name too); --device wins")
    rebalance_check_interval_s: float = Field(
        default=5.0, gt=0, description="`hearth host`: how often it reads the mesh's coverage for a hole to fill")
    rebalance_hold_s: float = Field(
        default=15.0, ge=0,
        description="`hearth host`: a hole must be seen this long (and a range keeping the layers only this host "
                    "holds must fill some of it, or bring the host a step nearer it) before it moves there")
    move_drain_timeout_s: float = Field(
        default=120.0, ge=0,
        description="`hearth host`: moving, it withdraws its range at once (no new call is routed to it) and waits "
                    "this long at most for the calls going through it to end before it stops serving it")
    move_wait_max_s: float = Field(
        default=300.0, ge=0,
        description="`hearth host`: while another host moves (its old range withdrawn, its new one not yet "
                    "advertised: draining, then loading) and is heard from (its heartbeats, within "
                    "shard_health_timeout_s), it decides no move of its own, so that both do not fill the same "
                    "hole; for at most this long per hole, whatever the mesh says")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto", description="compute dtype: auto is bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on "
                                    "the CPU; --dtype wins")
    quantize: Annotated[str, AfterValidator(check_runnable_setting)] = Field(
        default=AUTO_QUANTIZATION, pattern=QUANTIZE_SETTING_PATTERN,
        description="weights of the layers this machine serves (shards, an orchestrator's head and local model): "
                    "auto (as the checkpoint stores them: a GGUF whose layers are mostly 4-bit blocks as int4, "
                    "mostly 5- to 8-bit blocks as int8, any other checkpoint as none), none, int8 (per output "
                    "channel) or int4, int4/gN (groups of N inputs: 32, 64, 128 or 256); CPU, and CUDA (int4 from "
                    "compute capability 8.0, below which auto takes int8); --quantize wins")


class DistributedInferenceSettings(ConfigSection):
    """[research.distributed_inference]: routing, health and failover of sharded pipelines."""

    enabled: bool = Field(
        default=True,
        description="the specification's switch of this feature; the orchestrator serves calls only while both it "
                    "and [research] enable are true (either false: every call is answered experimental_disabled)")
    # At most what a pipeline event may list (events.envelope.max_event_hops).
    max_shards_per_request: int = Field(default=16, ge=1, le=max_event_hops)
    shard_health_timeout_s: float = Field(
        default=30, gt=0,
        description="routing leaves out a shard whose newest heartbeat (or advertisement) is older than this")
    silent_log_grace_s: float = Field(
        default=30, ge=0,
        description="while no shard's heartbeat reaches the read model (the heartbeats' stream electing a leader, a "
                    "restarted projector catching up), routing judges health and expiry against the newest one "
                    "heard instead of the wall clock, for at most this long: a silent log is not dead shards")
    fallback_to_local: bool = True
    fallback_to_local_after_failures: int = Field(default=2, ge=0)
    activation_dtype: Literal["auto", "fp16", "fp32", "int8"] = "auto"
    allow_self_as_shard: bool = False
    max_concurrent_pipelines: int = Field(default=4, ge=1)
    max_eviction_reprefills: int = Field(
        default=64, ge=0,
        description="re-prefills of one call after a hop answered `session_evicted`; one more fails over instead")
    host: HostSettings = HostSettings()


class ResearchSettings(ConfigSection):
    """[research]: the experimental feature switch; false answers every request with experimental_disabled."""

    enable: bool = Field(
        default=True,
        description="the switch that rules: false answers every call with experimental_disabled, whatever "
                    "[research.distributed_inference] enabled says (both must be true to serve)")
    distributed_inference: DistributedInferenceSettings = DistributedInferenceSettings()


class TransportSettings(ConfigSection):
    """[transport]: the activation transport of docs/design.md §6."""

    window_chunks: int = Field(default=16, ge=1, description="un-acked chunks in flight per hop")
    activation_macs: bool = Field(
        default=True, description="MAC every frame and ack with per-link keys; false only to measure their cost")
    seal_activations: bool = Field(
        default=True,
        description="encrypt every activation frame end to end between the two ends of its link (AES-256-GCM under a "
                    "key derived from the link key), so the broker's host sees only ciphertext; false: frames are "
                    "only MACed (readable by whoever runs the broker). An orchestrator opens its pipelines in its "
                    "own mode; needs activation_macs")
    chunk_bytes: int = Field(default=1 * MiB, ge=smallest_chunk_bytes, description="largest payload of one frame")
    step_timeout_s: float = Field(
        default=10.0, gt=0, description="a hop that has not passed a step on within this is stalled"
    )
    gone_check_after_s: float = Field(
        default=0.5, gt=0,
        description="a step held this long makes the orchestrator check that the hops holding it are still "
                    "connected, and again as often while it stays held (a dead host is failed over at once "
                    "instead of after step_timeout_s)",
    )
    prefill_timeout_per_token_s: float = Field(
        default=0.01, ge=0, description="added to step_timeout_s per prompt token of a prefill step")
    control_timeout_s: float = Field(default=5.0, gt=0, description="how long an open/close/stat request waits")
    probe_timeout_s: float = Field(
        default=0.5, gt=0, description="a shard silent to the gone check and then to a probe this long is cut off, "
                                       "frozen or gone (failed over before step_timeout_s); a starting shard "
                                       "keeps its id when no earlier claim on it is heard this long after asking "
                                       "(and gives it up on one heard later)")
    gone_check_timeout_s: float = Field(
        default=0.25, gt=0, description="'no responders' comes back at once; a slower answer proves nothing")
    hop_ack_timeout_s: float = Field(
        default=30.0, gt=0, description="a shard waits this long for the next hop to ack before giving a step up")
    keepalive_interval_s: float = Field(
        default=0.5, gt=0,
        description="the orchestrator tells its client and its hops it is alive at least this often")
    orphan_timeout_s: float = Field(
        default=5.0, gt=0,
        description="a shard drops a hop whose orchestrator sent no frame and no keepalive for this long")
    int8_block_elems: int = Field(
        default=64, ge=1, le=max_int8_block_elems,
        description="elements per quantisation block when the wire dtype is int8")
    subscribe_timeout_s: float = Field(
        default=5.0, gt=0, description="how long starting a sender, receiver or ack observer waits for the broker")
    max_ready_steps: int = Field(
        default=8, ge=1,
        description="complete steps a receiver holds for its consumer; beyond that it stops acking (backpressure)")
    ready_wait_timeout_s: float = Field(
        default=30.0, gt=0, description="a complete step that finds no room for this long is dropped")
    max_step_bytes: int = Field(
        default=512 * MiB, ge=1, description="a receiver drops a step whose wire payload is larger than this")
    max_partial_steps: int = Field(
        default=64, ge=1, description="unfinished steps a receiver assembles at once; the oldest is abandoned")
    max_tracked_sessions: int = Field(
        default=4096, ge=1, description="sessions whose newest delivered step a receiver remembers")
    ack_observer_max_sessions: int = Field(
        default=1024, ge=1, description="sessions whose step progress an ack observer remembers")
    ack_observer_max_steps_per_session: int = Field(
        default=256, ge=1, description="steps per session whose progress an ack observer remembers")


class NatsSettings(ConfigSection):
    """[nats]: where the broker is; `--nats` and `$HEARTH_NATS_URL` on the command line win over this."""

    # nats-py's own parse of a bad URL ends in a traceback. $HEARTH_NATS_URL, this default, is checked where it is
    # read as --nats (services.cli_options) and by connect_nats.
    url: Annotated[str, AfterValidator(checked_nats_url)] = Field(default_factory=default_nats_url)
    connect_timeout_s: float = Field(
        default=10.0, gt=0,
        description="a long-running command that cannot reach the broker within this exits with one line")
    wait_for_broker: bool = Field(default=False, description="true: keep trying to reach the broker forever")
    streams_wait_s: float = Field(
        default=60.0, gt=0,
        description="on a community broker, how long a process waits at start for the steward to create the event "
                    "streams before it exits with one line (with wait_for_broker: as long as it takes)")
    streams_create_timeout_s: float = Field(
        default=30.0, gt=0,
        description="how long the steward's tooling (`hearth nats --community`, `hearth community streams`) keeps "
                    "trying to create the event streams on a broker whose JetStream is not ready yet")
    reconnect_wait_s: float = Field(default=0.5, gt=0, description="pause between reconnect attempts")
    # A link to a node that was partitioned away stays open while nothing arrives over it: only unanswered pings
    # reveal it, (max_outstanding_pings + 1) intervals after the last answer at most. 5 s and 2 notice it within
    # 10-15 s (nats-py's own 120 s and 2: minutes), yet a pong delayed by up to 10 s (a loaded machine) is no reason
    # to reconnect; a blocked event loop delays the pinging too, so it counts one missed ping at most.
    ping_interval_s: float = Field(
        default=5.0, gt=0,
        description="how often a client pings its NATS node; a link that answers none of max_outstanding_pings "
                    "pings in a row is dead and the client reconnects (to another node of a cluster)")
    max_outstanding_pings: int = Field(
        default=2, ge=1,
        description="unanswered pings a client tolerates before it takes its NATS link for dead (noticed within "
                    "ping_interval_s x (this + 1))")
    refused_grace_s: float = Field(
        default=1.0, ge=0,
        description="a first connect the broker refuses (authorization violation) is tried again for this long "
                    "before the command gives up: a broker reloading its configuration refuses briefly")
    close_timeout_s: float = Field(
        default=1.0, gt=0, description="how long closing a connection may take (the broker may be gone)")
    drain_timeout_s: float = Field(
        default=1.0, gt=0, description="at shutdown, how long flushing what we published may take before closing")
    creds_file: Path | None = Field(
        default=None, description="this member's nkey seed file (`hearth community add` writes it; --creds)")
    roster_file: Path | None = Field(
        default=None, description="the community roster (default: roster.json beside the key's keys/ folder)")
    insecure: bool = Field(
        default=False, description="true: run on an open broker without credentials (warned at every start)")
    tls_ca_file: Path | None = Field(
        default=None, description="CA certificate (PEM) that signed the broker's: set it to connect over TLS")
    tls_cert_file: Path | None = Field(
        default=None, description="this member's client certificate (PEM), for a broker that verifies clients")
    tls_key_file: Path | None = Field(default=None, description="the client certificate's private key (PEM)")


class EventsSettings(ConfigSection):
    """[events]: what a projector accepts from the event log of a community mesh (hearth/events/signing.py)."""

    max_clock_skew_s: float = Field(
        default=DEFAULT_MAX_CLOCK_SKEW_S, gt=0,
        description="an event whose occurred_at is more than this after the broker stored it is rejected "
                    "(future_dated), so no timestamp can pin routing")


class WeightsSettings(ConfigSection):
    """[weights]: how much of the broker's JetStream store the community's checkpoints (`hearth weights`) may take:
    the weights bucket's bound, which the server reserves beside the event streams' own
    (hearth/services/broker/weights_bucket.py)."""

    store_share: float = Field(
        default=0.8, gt=0, le=1,
        description="the weights bucket may hold this share of the room left in the store `hearth nats --community` "
                    "bounds, beyond what the event streams and the call-nonce bucket reserve (set at each start)")
    max_store_mb: float | None = Field(
        default=None, gt=0,
        description="the most the weights bucket may hold, in place of store_share; for a broker `hearth nats` does "
                    "not bound (a --node cluster, one started otherwise) `hearth community streams` and `hearth "
                    "weights publish` apply it, and without it publishing there is refused until the bucket has one")


class ReadModelSettings(ConfigSection):
    """[readmodels]: how long every read model (the projector's, an orchestrator's, a host's) keeps history, by the
    log's clock (docs/design.md §4, "Retention"); rows that are state are kept whatever their age."""

    shards_retention_days: float = Field(
        default=shards_max_age_s / seconds_per_day, gt=0,
        description="history of the shards stream (shards withdrawn or expired, their heartbeats, rejected "
                    "events, events per minute, the ids of applied events) is pruned this long after it, and an "
                    "event stored longer than this after it occurred is rejected (too_old); the stream's own max "
                    "age, so a rebuild from the log gives the same rows")
    pipelines_retention_days: float = Field(
        default=pipelines_max_age_s / seconds_per_day, gt=0,
        description="history of the pipelines stream (calls, failovers, per-minute rollups, integrity evidence of "
                    "no quarantine in force, rejected events, the ids of applied events) is pruned this long after "
                    "it, and an event stored longer than this after it occurred is rejected (too_old); the stream's "
                    "own max age")
    daily_totals_retention_days: float = Field(
        default=400.0, gt=0,
        description="tokens through each host per day (host_tokens_daily) are kept this long: one row per host "
                    "per day, a year's accounting and more, which the log no longer holds past the pipelines' "
                    "retention")
    rejected_samples_per_minute: int = Field(
        default=5, ge=0,
        description="rejected events kept as rows (rejected_events) per minute, stream and reason; every one is "
                    "still counted (rejected_event_counts), so a flood of junk adds a bounded number of rows")
    prune_interval_s: float = Field(
        default=60.0, gt=0, description="how often a projector prunes what aged past the retention")
    prune_batch_rows: int = Field(
        default=500, ge=1,
        description="rows deleted per transaction while pruning: the projector's batches go on between two")


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
    orchestrator: OrchestratorSettings = OrchestratorSettings()
    shard: ShardSettings = ShardSettings()
    prefix_cache: PrefixCacheSettings = PrefixCacheSettings()
    verification: VerificationSettings = VerificationSettings()
    client: ClientSettings = ClientSettings()
    gateway: GatewaySettings = GatewaySettings()
    events: EventsSettings = EventsSettings()
    readmodels: ReadModelSettings = ReadModelSettings()
    weights: WeightsSettings = WeightsSettings()
    metrics: MetricsSettings = MetricsSettings()

    @model_validator(mode="before")
    @classmethod
    def _keys_at_their_new_place(cls, data: Any) -> Any:
        return move_aliased_keys(data)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keys moved within each source on its own, so that precedence holds between a key's old name in one
        # source and its new name in another.
        sources: list[PydanticBaseSettingsSource] = [init_settings, KeysMovedSource(env_settings)]
        toml_path = _toml_path_being_loaded.get()
        if toml_path is not None:
            sources.append(KeysMovedSource(TomlConfigSettingsSource(settings_cls, toml_file=toml_path)))
        return tuple(sources)


# The file `load_settings` is reading; a context variable because pydantic-settings builds its sources
# in a classmethod that cannot receive per-call arguments.
_toml_path_being_loaded: ContextVar[Path | None] = ContextVar("hearth_toml_path", default=None)


def config_path_from_env() -> Path | None:
    value = os.environ.get(CONFIG_PATH_ENV, "").strip()
    return Path(value) if value else None


def load_settings(path: str | Path | None = None, **overrides: Any) -> HearthSettings:
    """Settings from the TOML file at `path` (or `$HEARTH_CONFIG`, or none), then env vars, then `overrides`.

    Raises ConfigError, one line saying what is wrong, when a named file does not exist, cannot be read or is not
    TOML, or when a setting is invalid or unknown.
    """
    toml_path = Path(path) if path is not None else config_path_from_env()
    if toml_path is not None and toml_path.is_dir():
        raise ConfigError(f"configuration file {toml_path} is a folder, not a file")
    if toml_path is not None and not toml_path.is_file():
        raise ConfigError(f"configuration file {toml_path} does not exist")
    token = _toml_path_being_loaded.set(toml_path)
    try:
        return HearthSettings(**overrides)
    except ValidationError as error:
        raise ConfigError(
            describe_invalid_configuration(error, toml_path, ENV_PREFIX, ENV_NESTED_DELIMITER)) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"configuration file {toml_path} is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"cannot read configuration file {toml_path}: {error}") from None
    except OSError as error:
        raise ConfigError(f"cannot read configuration file {toml_path}: {error.strerror or error}") from None
    except SettingsError as error:  # an environment variable holding a whole table that is not JSON
        raise ConfigError(f"invalid configuration: {error}") from None
    finally:
        _toml_path_being_loaded.reset(token)
