"""Prometheus helpers for hearth processes: get-or-create collectors on one registry, and the /metrics server."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)

from hearth.services.common.lifecycle import CommandRefused

log = logging.getLogger(__name__)

# No `<name>_created` sample beside every counter and histogram: Prometheus does not use them, and they would
# double what every scrape carries.
disable_created_metrics()

_Collector = TypeVar("_Collector", Counter, Gauge, Histogram)
# registry -> name -> collector: lets modules that are imported twice (tests, plugins) share one collector
# instead of failing with "Duplicated timeseries". Weakly keyed by the registry itself: an id would be reused by a
# later registry once the first is freed, which would then be handed a collector registered elsewhere.
_created: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Counter | Gauge | Histogram]] = (
    weakref.WeakKeyDictionary())
_created_lock = threading.Lock()


def _get_or_create(
    kind: type[_Collector],
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    registry: CollectorRegistry,
    **kwargs,
) -> _Collector:
    with _created_lock:
        by_name = _created.setdefault(registry, {})
        existing = by_name.get(name)
        if existing is not None:
            if not isinstance(existing, kind):
                raise ValueError(f"metric {name} already exists as a {type(existing).__name__}")
            return existing
        collector = kind(name, documentation, labelnames=tuple(labelnames), registry=registry, **kwargs)
        by_name[name] = collector
        return collector


def counter(
    name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry = REGISTRY
) -> Counter:
    return _get_or_create(Counter, name, documentation, labelnames, registry)


def gauge(
    name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry = REGISTRY
) -> Gauge:
    return _get_or_create(Gauge, name, documentation, labelnames, registry)


def histogram(
    name: str,
    documentation: str,
    labelnames: Sequence[str] = (),
    *,
    buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    registry: CollectorRegistry = REGISTRY,
) -> Histogram:
    return _get_or_create(Histogram, name, documentation, labelnames, registry, buckets=tuple(buckets))


def render_metrics(registry: CollectorRegistry = REGISTRY) -> str:
    """The registry in the Prometheus text format (what /metrics serves)."""
    return generate_latest(registry).decode()


def sample_value(name: str, labels: dict[str, str] | None = None, *, registry: CollectorRegistry = REGISTRY) -> float:
    """Current value of one sample (0.0 when it has not been created yet); for tests and CLIs."""
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


# How long stopping waits for the server's thread to end.
metrics_server_stop_timeout_s = 5.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """No line per scrape."""


class _ThreadingWsgiServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape under way does not hold the process's exit


@dataclass
class MetricsServer:
    """A running /metrics HTTP server; `stop()` shuts it down."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        """Where to scrape it from this machine (a server on every interface is reached on the loopback; an IPv6
        address goes in brackets)."""
        host = self._reachable_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    @property
    def _reachable_host(self) -> str:
        return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):  # its thread waits in accept: a connection wakes it to see the stop
            socket.create_connection((self._reachable_host, self.port), timeout=metrics_server_stop_timeout_s).close()
        self._thread.join(timeout=metrics_server_stop_timeout_s)
        self._server.server_close()


def _serve_until_stopped(server: WSGIServer, stopping: threading.Event) -> None:
    """Answer requests until `stopping` is set, waiting in accept meanwhile (socketserver's serve_forever looks for a
    shutdown twice a second, waking an idle process for nothing)."""
    while not stopping.is_set():
        server.handle_request()


def start_metrics_server(port: int, *, host: str, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; port 0 picks a free port. `host` is
    the interface ([metrics] host): /metrics has no authentication and names callers. CommandRefused when the
    address cannot be had (the port taken, an unknown host): one line, not a traceback."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsWsgiServer", (_ThreadingWsgiServer,), {"address_family": family})
        server = make_server(address[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    except OSError as error:
        raise CommandRefused(f"--metrics-port {port}: cannot listen on {host}:{port}: "
                             f"{error.strerror or error}") from None
    stopping = threading.Event()
    thread = threading.Thread(target=_serve_until_stopped, args=(server, stopping), name="metrics-http", daemon=True)
    thread.start()
    metrics_server = MetricsServer(host=host, port=server.server_address[1], _server=server, _thread=thread,
                                   _stopping=stopping)
    log.info("metrics on %s (interface %s)", metrics_server.url, host)
    return metrics_server


# Off in a process started with `--metrics-port 0`: nobody can scrape it, so the observations made for every step
# (shard step histograms, each hop's latency at the orchestrator) are skipped; rare counters are kept regardless.
_observed = True


def metrics_observed() -> bool:
    """Whether per-step observations are worth making in this process (see `serve_process_metrics`)."""
    return _observed


def set_metrics_observed(observed: bool) -> None:
    global _observed
    _observed = observed


def serve_process_metrics(port: int | None, process: str, *, host: str,
                          registry: CollectorRegistry = REGISTRY) -> MetricsServer | None:
    """A long-running process's `--metrics-port`: serve /metrics on `port` of interface `host` (`--metrics-host`,
    [metrics] host) and print where; for 0 serve nothing and stop the per-step observations; for None (a service
    run in-process, e.g. by a test) serve nothing."""
    if port is None:
        return None
    if port == 0:
        set_metrics_observed(False)
        return None
    set_metrics_observed(True)
    server = start_metrics_server(port, host=host, registry=registry)
    print(f"{process} metrics on {server.url}", flush=True)
    return server
