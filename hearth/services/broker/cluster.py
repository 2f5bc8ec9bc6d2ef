"""Runs nodes of hearth's NATS cluster: each a nats-server on the shared nats/hearth-cluster.conf, with its
own name, ports and store given through the environment, and the community's authorization and TLS added by a
small per-node file; `EmbeddedNatsCluster` runs several such nodes on one machine (`hearth nats --cluster 3`,
tests, LocalCluster).

Routes (the nodes' connections to one another) do not go through the client authorization, so they log in
with a password of their own: derived from the community's system key when there is a community (every node
holding the community folder derives the same one), else a random one per run (nodes on one machine only).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.server import (
    EmbeddedNatsServer,
    connection_limits_block,
    NatsServerError,
    readiness_poll_interval_s,
    why_it_exited,
)
from hearth.services.common.config_sections import loopback_host
from hearth.services.common.hearth_files import data_dir
from hearth.services.common.logging import log_tail_chars
from hearth.trust.community import Community

CLUSTER_CONFIG_NAME = "hearth-cluster.conf"
ROUTE_USER = "hearth-route"
DEFAULT_CLUSTER_SIZE = 3
# A node is healthy once it has joined the cluster and its stream replicas caught up with the leaders.
cluster_healthy_timeout_s = 30.0
monitor_request_timeout_s = 2.0
_route_password_context = b"hearth nats cluster routes"


def cluster_config_file() -> Path:
    """nats/hearth-cluster.conf of hearth's data folders (hearth/services/common/hearth_files.py), else in the current
    folder."""
    for folder in (data_dir("nats"), Path.cwd() / "nats"):
        candidate = folder / CLUSTER_CONFIG_NAME
        if candidate.is_file():
            return candidate
    raise NatsServerError(f"nats/{CLUSTER_CONFIG_NAME} not found among hearth's data files ({data_dir('nats')}) "
                          "or in the current folder; reinstall hearth")


def community_route_password(community: Community) -> str:
    """The cluster's route password: an HMAC of a fixed label under the community's system key (hex)."""
    return hmac.new(community.system_key().seed, _route_password_context, hashlib.sha256).hexdigest()


def random_route_password() -> str:
    return secrets.token_hex(16)


def route_urls(routes: list[str], password: str) -> list[str]:
    """`host:port` of every node's cluster listener -> the route URLs a node dials (with the credentials)."""
    return [f"nats://{ROUTE_USER}:{password}@{route}" for route in routes]


class ClusterNodeServer(EmbeddedNatsServer):
    """One cluster node: nats-server on a generated file that includes nats/hearth-cluster.conf and adds the
    authorization and TLS blocks; the node's own settings reach that file as HEARTH_NATS_* variables."""

    def __init__(self, *, name: str, routes: list[str], route_password: str, cluster_listen: str,
                 monitor_port: int | None = None, monitor_host: str = loopback_host, **server_options) -> None:
        super().__init__(**server_options)
        self.name = name
        self.routes = list(routes)
        self.route_password = route_password
        self.cluster_listen = cluster_listen
        self.monitor_port = monitor_port or free_tcp_port()
        self.monitor_host = monitor_host

    def render_config(self) -> str:
        # nats-server resolves `include` relative to the including file only.
        shared = os.path.relpath(cluster_config_file().resolve(), self.store_dir.resolve())
        return (f"# hearth nats: cluster node {self.name}; the shared part is nats/{CLUSTER_CONFIG_NAME}\n"
                f"include {json.dumps(shared)}\n"
                + connection_limits_block(self.max_connections, self.max_subscriptions)
                + (self.tls_block or "") + (self.authorization or ""))

    def config_environment(self) -> dict[str, str]:
        # nats-server parses each value as configuration: quoted strings stay strings, whatever they hold.
        values = {
            "NAME": self.name,
            "LISTEN": f"{self.host}:{self.port}",
            "MONITOR": f"{self.monitor_host}:{self.monitor_port}",
            "STORE": str((self.store_dir / "jetstream").resolve()),
            "MAX_FILE_STORE": self.store_bound,
            "CLUSTER_LISTEN": self.cluster_listen,
            "ROUTE_PASSWORD": self.route_password,
            "ROUTES": route_urls(self.routes, self.route_password),
        }
        return {f"HEARTH_NATS_{key}": json.dumps(value) for key, value in values.items()}

    # ------------------------------------------------------------------ monitoring

    def monitor(self, endpoint: str) -> dict:
        """GET one of the node's monitoring endpoints (`jsz`, `routez`, ...) as JSON."""
        url = f"http://{self.monitor_host}:{self.monitor_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=monitor_request_timeout_s) as response:
            return json.loads(response.read())

    def is_healthy(self) -> bool:
        """/healthz says ok: the node is in the cluster, JetStream is current, its replicas caught up."""
        try:
            return self.monitor("healthz").get("status") == "ok"
        except (OSError, urllib.error.URLError, ValueError):  # not listening yet, or 503 while it catches up
            return False

    def wait_healthy(self, timeout_s: float = cluster_healthy_timeout_s) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if not self.is_running():
                raise NatsServerError(f"nats-server {self.name} exited: {why_it_exited(self.log_tail())} (its log: "
                                      f"{self.store_dir / 'nats-server.log'})")
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server {self.name} not healthy within {timeout_s} s:\n{self.log_tail()}")
            time.sleep(readiness_poll_interval_s * 5)

    def log_tail(self, chars: int = log_tail_chars) -> str:
        return (self.store_dir / "nats-server.log").read_text(errors="replace")[-chars:]


class EmbeddedNatsCluster:
    """`size` clustered nodes on this machine (loopback routes); `url` lists every node's client URL.

    `node_hosts` gives each node an address of its own (its client, route and monitoring listeners; the ports
    must then be given too), and `start_in(i)` a context node i starts inside: the nodes of a test bed's
    households, each in its namespace (hearth/services/devtools/netbed.py)."""

    def __init__(self, size: int = DEFAULT_CLUSTER_SIZE, *, store_dir: str | Path, host: str = loopback_host,
                 ports: list[int] | None = None, cluster_ports: list[int] | None = None,
                 monitor_ports: list[int] | None = None, route_password: str | None = None,
                 authorization: str | None = None, tls_block: str | None = None,
                 start_new_session: bool = False, node_hosts: list[str] | None = None,
                 start_in: Callable[[int], AbstractContextManager] | None = None) -> None:
        if size < DEFAULT_CLUSTER_SIZE:
            raise ValueError(f"a cluster needs at least {DEFAULT_CLUSTER_SIZE} nodes (JetStream keeps 3 replicas)")
        if node_hosts is not None and (len(node_hosts) != size or not (ports and cluster_ports and monitor_ports)):
            raise ValueError("node_hosts needs one address per node and the nodes' ports")
        ports = ports or [free_tcp_port() for _ in range(size)]
        cluster_ports = cluster_ports or [free_tcp_port() for _ in range(size)]
        monitor_ports = monitor_ports or [free_tcp_port() for _ in range(size)]
        hosts = node_hosts or [host] * size
        route_hosts = node_hosts or ["127.0.0.1"] * size
        monitor_hosts = node_hosts or [loopback_host] * size
        routes = [f"{route_host}:{port}" for route_host, port in zip(route_hosts, cluster_ports)]
        password = route_password or random_route_password()
        self.start_in = start_in or (lambda index: nullcontext())
        self.nodes = [
            ClusterNodeServer(name=f"nats-{index}", routes=routes, route_password=password,
                              cluster_listen=routes[index], monitor_port=monitor_ports[index],
                              monitor_host=monitor_hosts[index], port=ports[index], host=hosts[index],
                              store_dir=Path(store_dir) / f"nats-{index}", authorization=authorization,
                              tls_block=tls_block, start_new_session=start_new_session)
            for index in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what `--nats` and HEARTH_NATS_URL take)."""
        return ",".join(self.urls)

    @property
    def store_bound(self) -> int | None:
        """The smallest node's `max_file_store` (None until every node started): a stream of one copy, such as the
        weights bucket, may lie on any node."""
        bounds = [node.store_bound for node in self.nodes]
        return None if None in bounds else min(bounds)

    def start(self, healthy_timeout_s: float = cluster_healthy_timeout_s) -> "EmbeddedNatsCluster":
        """Start every node, then wait until each has joined the cluster (its /healthz says ok)."""
        try:
            for index, node in enumerate(self.nodes):
                with self.start_in(index):
                    node.start()
            for node in self.nodes:
                node.wait_healthy(healthy_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def check_config(self) -> None:
        for node in self.nodes:
            node.check_config()

    def reload(self, authorization: str | None) -> None:
        for node in self.nodes:
            node.reload(authorization)

    def is_running(self) -> bool:
        """True while every node runs."""
        return all(node.is_running() for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> "EmbeddedNatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

