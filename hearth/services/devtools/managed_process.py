"""One process a LocalCluster started (hearth/services/devtools/local_cluster.py): its log, its ready file, its
/metrics port, its signals and its stop."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hearth.services.common.logging import log_tail_chars
from hearth.services.devtools.prefork import PreforkedProcess

process_stop_timeout_s = 15.0


def metrics_port_in(args: list[str]) -> int | None:
    """The port a `--metrics-port` among `args` names (the last one wins, as for the command), or None."""
    port = None
    for index, arg in enumerate(args):
        if arg == "--metrics-port" and index + 1 < len(args):
            port = int(args[index + 1])
        elif arg.startswith("--metrics-port="):
            port = int(arg.partition("=")[2])
    return port


@dataclass
class ManagedProcess:
    """A hearth process started as `name`, logging to `log_path`."""

    name: str
    popen: subprocess.Popen | PreforkedProcess
    log_path: Path
    ready_file: Path | None = None
    # Where it serves Prometheus /metrics on 127.0.0.1 (None: it serves none).
    metrics_port: int | None = None

    @property
    def metrics_url(self) -> str | None:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    def log_tail(self, chars: int = log_tail_chars) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            self.popen.send_signal(signum)

    def stop(self, timeout_s: float = process_stop_timeout_s) -> int | None:
        if self.alive:
            self.popen.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode
