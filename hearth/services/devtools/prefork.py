"""Prefork launcher: one process imports torch, transformers and hearth once, then forks each `hearth` command
LocalCluster asks for, so a mesh of N processes pays the import once instead of N times.

The children are real processes (own pid, memory, signals and exit status: tests kill them and read /proc); only
their start differs: a fork of a parent that imported the modules but ran nothing (no torch operation, event loop or
thread of its own), as PyTorch's DataLoader starts its workers. Settings that libraries read at import (OpenMP's
wait policy, Hugging Face's offline flags) are part of a launcher's identity: a command whose environment differs in
them gets its own launcher (`import_environment`).

Wire (JSON lines): the client writes a `SpawnRequest` on the launcher's stdin; the launcher answers each with a
`SpawnReply` on its stdout, in order, and an `ExitReport` whenever a child ends (only their parent can reap them).

The launcher's own side is services.devtools.prefork_launcher, run as `python -m` by `PreforkLauncher`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hearth.services.common.logging import log_tail_chars

log = logging.getLogger(__name__)

# What a child runs (named, not imported: the CLI loads the tooling that starts the launcher), as `python -m hearth`
# does: running this module, preloaded, as __main__ again would put runpy's RuntimeWarning in every child's log.
HEARTH_MODULE = "hearth.services.cli"
# The launcher process's module (run with -m).
LAUNCHER_MODULE = "hearth.services.devtools.prefork_launcher"
# Imported by the launcher before it forks anything: every module a long-running `hearth` command loads.
PRELOADED_MODULES = (
    HEARTH_MODULE,
    "hearth.services.shard.main",
    "hearth.services.orchestrator.main",
    "hearth.services.projector.main",
    "hearth.services.gateway.command",
    "hearth.services.host.main",
    "uvloop",
)
# Environment read while those modules are imported (by libgomp, torch, Hugging Face, Python itself): two
# commands share a launcher only when these agree.
IMPORT_ENVIRONMENT_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "HF_",
                               "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "LD_", "XDG_", "HOME")
# Of those, read only once a command runs, after the fork (hearth_files.state_dir): the test suite gives each test its
# own state folder, and a launcher per test would pay the imports again each time.
RUN_TIME_ENVIRONMENT = frozenset({"XDG_STATE_HOME"})
# How long the launcher may take to import PRELOADED_MODULES and answer its first request.
launcher_start_timeout_s = 120.0
# The launcher wakes this often even without a request or a SIGCHLD, to notice a lost wake-up.
launcher_poll_interval_s = 1.0


class LauncherError(RuntimeError):
    """The prefork launcher did not start, died, or refused a request."""


class SpawnRequest(BaseModel):
    """Fork a child that runs `hearth <argv>` with exactly `env`, in `cwd`, its stdout and stderr appended to
    `log_path` and stdin from /dev/null."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["spawn"] = "spawn"
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str
    # The child calls setsid(): out of reach of the terminal's Ctrl-C (LocalCluster.start_new_session).
    new_session: bool = False
    # The cores the child may run on (sched_setaffinity); None: any.
    cpus: list[int] | None = None


class SpawnReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["spawned"] = "spawned"
    pid: int | None = None
    # Why no child was forked (pid is then None).
    error: str | None = None


class ExitReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["exited"] = "exited"
    pid: int
    # As subprocess.Popen.returncode: the exit code, or -N when signal N ended it.
    returncode: int


class LauncherMessage(BaseModel):
    """What the launcher writes: one of its two message types, told apart by `type`."""

    message: SpawnReply | ExitReport = Field(discriminator="type")


def import_environment(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` modules read as they are imported: a launcher serves only commands whose own is equal."""
    return tuple(sorted((key, value) for key, value in env.items()
                        if key.startswith(IMPORT_ENVIRONMENT_PREFIXES) and key not in RUN_TIME_ENVIRONMENT))


# ------------------------------------------------------------------ the client side


class PreforkedProcess:
    """A child of a PreforkLauncher, with the part of subprocess.Popen's interface LocalCluster and its users
    need (pid, poll, wait, send_signal, terminate, kill, returncode)."""

    def __init__(self, launcher: PreforkLauncher, pid: int, args: Sequence[str]) -> None:
        self._launcher = launcher
        self.pid = pid
        self.args = list(args)

    @property
    def returncode(self) -> int | None:
        return self._launcher.returncode_of(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._launcher.wait_for_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        # As Popen: no signal once the exit is known (the pid may belong to someone else by then).
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreforkLauncher:
    """Owns one launcher process (started with `env`) and the exit statuses it reports."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self._exits: dict[int, int] = {}
        self._condition = threading.Condition()
        self._request_lock = threading.Lock()
        self._replies: list[SpawnReply] = []
        self._alive = True
        # What the launcher itself says (an import that failed, a crash) is kept for LauncherError's message.
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-m", LAUNCHER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=str(cwd))
        self._reader = threading.Thread(target=self._read_messages, name="prefork-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def _read_messages(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                message = LauncherMessage.model_validate({"message": json.loads(line)}).message
            except ValueError:
                log.warning("prefork launcher wrote a line that is no message: %r", line[:200])
                continue
            with self._condition:
                if isinstance(message, ExitReport):
                    self._exits[message.pid] = message.returncode
                else:
                    self._replies.append(message)
                self._condition.notify_all()
        with self._condition:
            self._alive = False
            self._condition.notify_all()

    def spawn(self, request: SpawnRequest) -> PreforkedProcess:
        with self._request_lock:
            assert self._process.stdin is not None
            try:
                self._process.stdin.write((request.model_dump_json() + "\n").encode())
                self._process.stdin.flush()
            except OSError as error:
                raise LauncherError(f"prefork launcher is gone: {error}") from error
            with self._condition:
                if not self._condition.wait_for(lambda: self._replies or not self._alive,
                                                timeout=launcher_start_timeout_s):
                    raise LauncherError(f"prefork launcher did not answer within {launcher_start_timeout_s} s")
                if not self._replies:
                    raise LauncherError(f"prefork launcher exited with {self._process.poll()}: "
                                        f"{self._stderr_tail()}")
                reply = self._replies.pop(0)
        if reply.pid is None:
            raise LauncherError(f"prefork launcher refused: {reply.error}")
        return PreforkedProcess(self, reply.pid, request.argv)

    def _stderr_tail(self, chars: int = log_tail_chars) -> str:
        with contextlib.suppress(OSError):
            self._stderr.seek(0)
            return self._stderr.read().decode(errors="replace")[-chars:]
        return ""

    def returncode_of(self, pid: int) -> int | None:
        with self._condition:
            code = self._exits.get(pid)
            if code is None and not self._alive and not _pid_exists(pid):
                code = self._exits[pid] = -signal.SIGKILL  # reaped by init once the launcher died: unknown
            return code

    def wait_for_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.returncode_of(pid)
            if code is not None:
                return code
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            with self._condition:
                # Bounded even without a deadline: a dead launcher's children are polled through /proc.
                self._condition.wait(timeout=min(remaining or launcher_poll_interval_s, launcher_poll_interval_s))

    def close(self) -> None:
        """End the launcher at once, as its owner exits; children it forked keep running until their owners stop them.

        Killed rather than asked: it keeps nothing worth a clean exit, and it may still be importing (a stop
        while a mesh starts), which would delay its owner's exit by seconds. Killed before its stdin closes: a
        launcher that reads the end of its stdin takes its owner for gone and ends its children (once SIGKILL is
        sent it runs nothing more). Its death is not waited for: freeing a torch-sized address space takes a
        loaded machine's CPU for a while, and the owner ending now hands the reaping to init."""
        self._process.kill()
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        self._process.poll()
        self._stderr.close()


def _pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


_launchers: dict[tuple[tuple[str, str], ...], PreforkLauncher] = {}
_launchers_lock = threading.Lock()


def prefork_launcher(env: Mapping[str, str], cwd: Path) -> PreforkLauncher:
    """The process-wide launcher for commands whose import environment is `env`'s, started on first use and
    kept for later clusters (a test session pays the imports once per distinct environment)."""
    key = import_environment(env)
    with _launchers_lock:
        launcher = _launchers.get(key)
        if launcher is None or not launcher.alive:
            launcher = _launchers[key] = PreforkLauncher(env, cwd)
        return launcher


@atexit.register
def _close_launchers() -> None:
    with _launchers_lock:
        for launcher in _launchers.values():
            launcher.close()
        _launchers.clear()

