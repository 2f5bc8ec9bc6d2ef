"""The base every section of hearth's configuration shares, and the sections read by the processes at the mesh's
edge: `[client]` (`hearth chat`), `[gateway]` (the OpenAI-compatible HTTP gateway) and `[metrics]` (every
process's /metrics server). hearth/services/common/config.py composes them with the rest into HearthSettings."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from hearth.protocol.bounds import max_retry_after_s


# Where a listener binds unless told otherwise: this machine only.
loopback_host = "127.0.0.1"
# The largest TCP port: every port option and setting is bounded by it.
max_tcp_port = 65535


class ConfigSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClientSettings(ConfigSection):
    """[client]: how `hearth chat` (and services.client.chat) waits for frames."""

    first_frame_timeout_s: float = Field(
        default=10.0, gt=0, description="no frame at all within this: no orchestrator took the call")
    silence_timeout_s: float = Field(
        default=2.5, gt=0,
        description="no frame and no keepalive for this long after the first: the orchestrator is gone")


class GatewaySettings(ConfigSection):
    """[gateway]: the OpenAI-compatible HTTP gateway (`hearth gateway`, hearth/services/gateway/)."""

    host: str = Field(default=loopback_host, description="interface to listen on; 0.0.0.0 to accept other machines")
    port: int = Field(default=8000, ge=0, le=max_tcp_port, description="TCP port to listen on (0: any free port)")
    community_dir: Path | None = Field(
        default=None, description="community folder holding api_keys.json and the keys of the members it names")
    max_open_requests: int = Field(
        default=1024, ge=1, description="calls in flight at once; one more is refused with 429 `overloaded`")
    retry_after_s: float = Field(
        default=1.0, gt=0, le=max_retry_after_s,
        description="the Retry-After of a 429 or 503 whose refusal names no wait of its own (spread per answer), "
                    "and of the gateway's own limits while no call has ended yet")
    api_keys_recheck_s: float = Field(
        default=1.0, gt=0, description="how often at most the gateway looks whether api_keys.json or the roster "
                                       "changed (a key made or revoked takes effect within this, no restart)")
    models_timeout_s: float = Field(
        default=5.0, gt=0, description="how long asking `llm.models` (GET /v1/models, a model check) may take")
    models_cache_s: float = Field(
        default=10.0, ge=0, description="how long a call without `model` takes the default model from the last "
        "`llm.models` answer before asking again; an older answer still serves while asking fails or times out")
    shutdown_grace_s: float = Field(
        default=1.0, ge=0, description="at shutdown, how long calls in flight may take to finish; those still open "
        "then are answered 503 `gateway_stopping` (an error event mid-stream)")
    max_open_requests_per_caller: int = Field(
        default=4, ge=1, description="calls in flight at once of one member (all its API keys together); one "
                                     "more is refused with 429 `overloaded` and a Retry-After")
    request_read_timeout_s: float = Field(
        default=20.0, gt=0, description="a connection that has not sent a whole request (headers and body) within "
                                        "this of opening, or of its previous answer, is closed")
    write_stall_timeout_s: float = Field(
        default=30.0, gt=0, description="a connection whose client has read none of an answer's pending bytes for "
                                        "this long is dropped, and its call ends as if the client had left")
    keep_alive_timeout_s: float = Field(
        default=5.0, gt=0, description="an idle connection between two requests is closed after this")
    max_connections: int = Field(
        default=2048, ge=1, description="connections open at once (uvicorn's limit_concurrency); a request "
                                        "arriving beyond them is answered 503")
    listen_backlog: int = Field(
        default=2048, ge=1, description="connections the kernel holds before the gateway accepts them")
    max_header_bytes: int = Field(
        default=16 * 1024, ge=1024, description="a request line and headers that grow past this before they end "
                                                "are answered 400 (h11's max_incomplete_event_size)")
    remembered_conversations: int = Field(
        default=4096, ge=0, description="conversations whose answering orchestrator the gateway remembers (least "
                                        "recently used forgotten), so that a next turn goes where its history is "
                                        "kept; 0: every call goes to the orchestrators' queue group")
    cors_allowed_origins: list[str] = Field(
        default=[], description="web origins (e.g. https://chat.example.org) whose pages may call the "
                                          "API from a browser; empty: no CORS headers at all")


class MetricsSettings(ConfigSection):
    """[metrics]: where a process's Prometheus /metrics server listens (`--metrics-port` turns it on)."""

    host: str = Field(
        default=loopback_host, description="interface /metrics listens on (`--metrics-host`); it has no "
                                         "authentication and names callers, so 0.0.0.0 only where the network is "
                                         "private (a Prometheus in another container)")
