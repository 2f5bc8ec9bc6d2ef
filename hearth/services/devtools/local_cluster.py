"""LocalCluster: starts and stops a whole hearth mesh on one machine as real processes (demo, bench, e2e tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hearth.services.broker.streams import create_community_streams_blocking
from hearth.services.broker.weights_bucket import weights_bucket_bound_bytes
from hearth.services.common.child_processes import ends_with_this_process
from hearth.services.common.config import ENV_NESTED_DELIMITER, ENV_PREFIX, NatsSettings, WeightsSettings
from hearth.services.common.hearth_files import SOURCES_ROOT
from hearth.services.common.logging import default_log_level
from hearth.services.common.scratch_folders import ScratchFolder
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.cluster import EmbeddedNatsCluster
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.devtools.prefork import HEARTH_MODULE, PreforkedProcess, SpawnRequest, prefork_launcher
from hearth.services.broker.tls import TlsFiles, write_throwaway_ca
from hearth.services.devtools.core_sharing import pinned_command, quiet_torch_environment
from hearth.services.devtools.managed_process import ManagedProcess, metrics_port_in
from hearth.trust.community import Community
from hearth.trust.roster import Role

process_ready_timeout_s = 120.0
ready_poll_interval_s = 0.05
# Set to 1 (the test suite does): LocalCluster forks its processes from a prefork launcher by default.
PREFORK_ENV = "HEARTH_PREFORK"


class ClusterError(RuntimeError):
    """A process of the cluster did not start; the message carries the tail of its log."""


def _device_argument(args: Sequence[str]) -> str | None:
    """The value of `--device` in a command's arguments, if it has one."""
    for index, arg in enumerate(args):
        if arg == "--device" and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith("--device="):
            return arg.partition("=")[2]
    return None


def _computes_on_gpu(device: str) -> bool:
    """True for `cuda`, `cuda:N`, and `auto` where torch sees a GPU (the shard validates the spec itself)."""
    text = device.strip().lower()
    if text == "auto":
        import torch

        return torch.cuda.is_available()
    return text.startswith("cuda")


def even_layer_ranges(num_layers: int, shards: int) -> list[tuple[int, int]]:
    """Split layers 0..num_layers-1 into `shards` contiguous ranges whose sizes differ by at most one."""
    if not 1 <= shards <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {shards} shards")
    base, extra = divmod(num_layers, shards)
    ranges, lo = [], 0
    for index in range(shards):
        size = base + (1 if index < extra else 0)
        ranges.append((lo, lo + size - 1))
        lo += size
    return ranges


# While a process serves several streams, its steps run on one intra-op thread so the hops of concurrent
# sessions use the cores side by side (inference.compute_thread.StepThreads).
shared_machine_busy_threads = 1
# Shards sharing the machine's cores merge sessions that decode in groups into one batch ([shard]
# batch_merge_window_ms, hearth/services/common/batching.py): one batch using every core beats groups pipelined
# through hops that take turns on the same cores.
shared_machine_batch_merge_window_ms = 200.0
BATCH_MERGE_WINDOW_ENV = f"{ENV_PREFIX}SHARD{ENV_NESTED_DELIMITER}BATCH_MERGE_WINDOW_MS"
# What the processes keep across restarts lives in work_dir, with the broker: in the default state folder, what one
# mesh's process left would be written to the next mesh's broker by a process of the same node id.
OUTBOX_DIR_ENV = f"{ENV_PREFIX}ORCHESTRATOR{ENV_NESTED_DELIMITER}EVENT_OUTBOX_DIR"
SHARD_OUTBOX_DIR_ENV = f"{ENV_PREFIX}SHARD{ENV_NESTED_DELIMITER}EVENT_OUTBOX_DIR"


def prefork_from_environment(*, default: bool) -> bool:
    """HEARTH_PREFORK's choice (1/true/yes or 0/false/no), `default` when it is unset or empty."""
    value = os.environ.get(PREFORK_ENV, "").strip().lower()
    return default if not value else value in ("1", "true", "yes")


@dataclass
class LocalCluster:
    """`start_*` methods launch processes; `close()` stops everything this object started, newest first."""

    work_dir: Path | None = None
    nats_url: str | None = None
    torch_threads: int | None = None
    log_level: str = default_log_level
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)
    # True: every process runs in its own session, out of reach of the terminal's Ctrl-C, so the owner
    # (hearth demo) stops them in order (clients before the broker) instead of all dying at once.
    start_new_session: bool = False
    # Secure by default: a throwaway community in work_dir/community, every process logs in with its own member
    # key and the broker enforces each role's permissions. False: an open broker (no credentials at all).
    secure: bool = True
    # True: the broker speaks only TLS (certificates from a throwaway CA in work_dir/tls) and verifies clients.
    tls: bool = False
    # True: every hearth process serves /metrics on a free port (`--metrics-port`) unless its arguments name one.
    metrics: bool = True
    # True: hearth processes are forked from a launcher that has imported torch and transformers once
    # (services.devtools.prefork), so a mesh starts in seconds; None: as the HEARTH_PREFORK environment says
    # (the test suite sets it), else each process is a fresh `python -m hearth.services.cli`.
    prefork: bool | None = None
    # The names and addresses the broker's TLS certificate is valid for (the broker's host, as clients dial it).
    tls_host_names: tuple[str, ...] = ("localhost", "127.0.0.1")

    def __post_init__(self) -> None:
        self._tmp = None
        if self.work_dir is None:
            self._tmp = ScratchFolder("hearth-cluster-")  # a killed owner's is removed by the next cluster's
            self.work_dir = self._tmp.path
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.nats: EmbeddedNatsServer | EmbeddedNatsCluster | None = None
        self.community: Community | None = None
        if self.secure:
            community_dir = self.work_dir / "community"
            self.community = (Community(community_dir) if (community_dir / "roster.json").exists()
                              else Community.init(community_dir, "local"))
        self.tls_files: TlsFiles | None = (write_throwaway_ca(self.work_dir / "tls", self.tls_host_names)
                                           if self.tls else None)

    def _tls_settings(self) -> dict[str, Path]:
        if self.tls_files is None:
            return {}
        return {"tls_ca_file": self.tls_files.ca_file, "tls_cert_file": self.tls_files.client_cert_file,
                "tls_key_file": self.tls_files.client_key_file}

    # ------------------------------------------------------------------ credentials

    def _authorization(self) -> str | None:
        if self.community is None:
            return None
        return render_authorization(self.community.roster())

    def member_key(self, name: str, role: Role) -> Path | None:
        """The key file of member `name` (added with `role` on first use, the broker reloaded); None when open."""
        if self.community is None:
            return None
        existing = self.community.roster().by_name(name)
        if existing is None:
            self.community.add(name, role)
            if self.nats is not None:
                self.nats.reload(self._authorization())
        elif existing.role != role:
            raise ClusterError(f"member {name} is a {existing.role}, not a {role}")
        return self.community.directory / "keys" / f"{name}.nk"

    def credentials_env(self, creds_file: Path | None) -> dict[str, str]:
        """Environment that makes a hearth process log in with `creds_file`, or run with --insecure when the
        cluster's broker is open."""
        env = {f"HEARTH_NATS__{key.upper()}": str(path) for key, path in self._tls_settings().items()}
        if creds_file is None:
            return {**env, "HEARTH_NATS__INSECURE": "1"} if self.community is None else env
        env["HEARTH_NATS__CREDS_FILE"] = str(creds_file)
        if self.community is not None and creds_file.parent.name == "keys":
            env["HEARTH_NATS__ROSTER_FILE"] = str(self.community.roster_path)
        return env

    @property
    def system_creds(self) -> Path | None:
        """The server's system user's key: may watch and do everything (tests and the demo's own checks)."""
        return self.community.system_key_path if self.community is not None else None

    def nats_settings(self, creds_file: Path | None = None) -> NatsSettings:
        """Settings for connect_nats to this cluster's broker, as `creds_file`'s member (default: the system
        user, which tests use to watch everything)."""
        return NatsSettings(url=self.nats_url, creds_file=creds_file or self.system_creds,
                            roster_file=self.community.roster_path if self.community else None,
                            **self._tls_settings())

    def client_env(self, name: str = "local-client") -> dict[str, str]:
        """Environment for a `hearth chat`/`hearth models` child process as client member `name`."""
        return self.credentials_env(self.member_key(name, "client"))

    # ------------------------------------------------------------------ processes

    def start_nats(self, *, cluster_size: int | None = None, **server_options) -> str:
        """Start an embedded nats-server (options as EmbeddedNatsServer's, e.g. max_payload_bytes), or with
        `cluster_size` that many clustered ones (`self.nats` is then an EmbeddedNatsCluster; the URL lists them)."""
        server_options.setdefault("start_new_session", self.start_new_session)
        access = dict(authorization=self._authorization(),
                      tls_block=self.tls_files.server_block() if self.tls_files else None)
        if cluster_size is not None:
            self.nats = EmbeddedNatsCluster(cluster_size, store_dir=self.work_dir / "nats", **access,
                                            **server_options).start()
        else:
            self.nats = EmbeddedNatsServer(store_dir=self.work_dir / "nats", **access, **server_options).start()
        self.nats_url = self.nats.url
        if self.community is not None:  # as `hearth nats --community` does: only the steward may create them
            settings = self.nats_settings()
            create_community_streams_blocking(settings, self.system_creds,
                                              ready_timeout_s=settings.streams_create_timeout_s,
                                              weights_max_bytes=weights_bucket_bound_bytes(WeightsSettings(),
                                                                                           self.nats.store_bound))
        return self.nats_url

    def _spawn(self, name: str, args: list[str], *, wait_ready: bool = True, writes_ready_file: bool = True,
               member: tuple[str, Role] | None = None, env: dict[str, str] | None = None,
               cpus: Sequence[int] | None = None, command_prefix: Sequence[str] = (),
               nats_url: str | None = None) -> ManagedProcess:
        if self.nats_url is None:
            raise ClusterError("start NATS (or give nats_url) before starting hearth processes")
        log_path = self.work_dir / f"{name}.log"
        ready_file = self.work_dir / f"{name}.ready"
        ready_file.unlink(missing_ok=True)
        credentials = self.credentials_env(self.member_key(*member) if member else None)
        env = {**os.environ, **quiet_torch_environment(self.torch_threads), **self.extra_env, **credentials,
               "HEARTH_NATS_URL": nats_url or self.nats_url, "PYTHONUNBUFFERED": "1", **(env or {})}
        hearth_args = ["--log-level", self.log_level, *args, "--nats", nats_url or self.nats_url]
        if writes_ready_file:
            hearth_args += ["--ready-file", str(ready_file)]
        metrics_port = metrics_port_in(args)
        if metrics_port is None and self.metrics:
            metrics_port = free_tcp_port()
            hearth_args += ["--metrics-port", str(metrics_port)]
        popen = self._launch(hearth_args, env, log_path, cpus, command_prefix)
        process = ManagedProcess(name, popen, log_path, ready_file if writes_ready_file else None,
                                 metrics_port=metrics_port or None)
        self.processes.append(process)
        if wait_ready:
            self.wait_ready(process)
        return process

    def _launch(self, hearth_args: list[str], env: dict[str, str], log_path: Path,
                cpus: Sequence[int] | None, command_prefix: Sequence[str] = ()) -> subprocess.Popen | PreforkedProcess:
        """`hearth <hearth_args>` as a fork of the prefork launcher, or as a fresh `python -m hearth.services.cli` run
        behind `command_prefix` (e.g. `ip netns exec NAME`: the launcher's forks could not run behind one)."""
        repo_root = SOURCES_ROOT
        if self._prefork_enabled() and not command_prefix:
            log_path.touch()
            return prefork_launcher(env, repo_root).spawn(SpawnRequest(
                argv=hearth_args, env=env, cwd=str(repo_root), log_path=str(log_path),
                new_session=self.start_new_session, cpus=sorted(set(cpus)) if cpus else None))
        command, pin = pinned_command([*command_prefix, sys.executable, "-m", HEARTH_MODULE, *hearth_args], cpus)
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=str(repo_root), start_new_session=self.start_new_session,
                                    preexec_fn=ends_with_this_process(then=pin))

    def _prefork_enabled(self) -> bool:
        return self.prefork if self.prefork is not None else prefork_from_environment(default=False)

    def wait_ready(self, process: ManagedProcess, timeout_s: float = process_ready_timeout_s) -> None:
        deadline = time.monotonic() + timeout_s
        if process.ready_file is None:
            return
        while not process.ready_file.exists():
            if not process.alive:
                raise ClusterError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{process.name} not ready within {timeout_s} s:\n{process.log_tail()}")
            time.sleep(ready_poll_interval_s)

    def start_shard(self, model: str, lo: int, hi: int, *, node_id: str, extra_args: list[str] = (),
                    wait_ready: bool = True, cpus: Sequence[int] | None = None,
                    command_prefix: Sequence[str] = (), nats_url: str | None = None) -> ManagedProcess:
        """`hearth shard` serving layers lo..hi; `cpus`: the cores it may run on (None: any); `command_prefix`:
        what it runs behind (hearth/services/devtools/netbed.py: a household's namespace); `nats_url`: the broker it
        dials instead of the cluster's (a household's latency relay)."""
        args = ["shard", "--model", model, "--layers", f"{lo}-{hi}", "--node-id", node_id,
                "--busy-threads", str(shared_machine_busy_threads), *extra_args]
        if self.torch_threads:
            args += ["--torch-threads", str(self.torch_threads)]
        return self._spawn(f"shard-{node_id}-{lo}-{hi}", args, wait_ready=wait_ready, member=(node_id, "shard"),
                           cpus=cpus, env=self.shard_host_env(cpus, _device_argument(args)),
                           command_prefix=command_prefix, nats_url=nats_url)

    def start_host(self, model: str, memory_budget_mb: float, *, node_id: str, extra_args: list[str] = (),
                   wait_ready: bool = True, name: str | None = None) -> ManagedProcess:
        """`hearth host`: a shard host that chooses its own layers within `memory_budget_mb`; `name` (default:
        host-NODE) names its log and ready file, for several hosts of one node."""
        args = ["host", "--model", model, "--memory-budget-mb", repr(memory_budget_mb), "--node-id", node_id,
                "--busy-threads", str(shared_machine_busy_threads), *extra_args]
        if self.torch_threads:
            args += ["--torch-threads", str(self.torch_threads)]
        return self._spawn(name or f"host-{node_id}", args, wait_ready=wait_ready, member=(node_id, "shard"),
                           env=self.shard_host_env(None, _device_argument(args)))

    def shard_host_env(self, cpus: Sequence[int] | None, device: str | None) -> dict[str, str]:
        """A shard host's settings: its event outbox in work_dir, and sharing the machine's cores with the others."""
        return {SHARD_OUTBOX_DIR_ENV: str(self.work_dir / "shard-event-outbox"),
                **self.shared_machine_shard_env(cpus, device)}

    def shared_machine_shard_env(self, cpus: Sequence[int] | None, device: str | None = None) -> dict[str, str]:
        """A shard's settings for sharing the machine's cores with the others (unless pinned to cores of its own,
        computing on a GPU, or the caller's environment says otherwise)."""
        if cpus or BATCH_MERGE_WINDOW_ENV in self.extra_env or BATCH_MERGE_WINDOW_ENV in os.environ:
            return {}
        if device is not None and _computes_on_gpu(device):
            # A GPU's batched step is short, so waiting to merge groups costs more than one batch saves
            # (BENCHMARKS.md, "On a GPU").
            return {}
        return {BATCH_MERGE_WINDOW_ENV: repr(shared_machine_batch_merge_window_ms)}

    def start_even_mesh(self, model: Path, num_layers: int, *, shards: int) -> None:
        """`shards` shard hosts splitting `model`'s layers evenly (bench-host-i serves range i) and an orchestrator
        with the model preloaded, all ready when this returns; NATS must be started."""
        for index, (lo, hi) in enumerate(even_layer_ranges(num_layers, shards)):
            self.start_shard(str(model), lo, hi, node_id=f"bench-host-{index}", wait_ready=False)
        self.start_orchestrator(extra_args=["--preload", str(model)], wait_ready=False)
        self.wait_all_ready()

    def start_orchestrator(self, *, node_id: str = "orchestrator", extra_args: list[str] = (),
                           wait_ready: bool = True, command_prefix: Sequence[str] = ()) -> ManagedProcess:
        args = ["orchestrator", "--node-id", node_id, "--busy-threads", str(shared_machine_busy_threads), *extra_args]
        args += ["--torch-threads", str(self.torch_threads)] if self.torch_threads else []
        return self._spawn(f"orchestrator-{node_id}", args, wait_ready=wait_ready, member=(node_id, "orchestrator"),
                           command_prefix=command_prefix, env={OUTBOX_DIR_ENV: str(self.work_dir / "event-outbox")})

    def start_gateway(self, *, name: str = "gateway", extra_args: list[str] = (), env: dict[str, str] | None = None,
                      wait_ready: bool = True) -> ManagedProcess:
        """`hearth gateway` on a free port, logged in as client member `name`, with the API keys of this cluster's
        community folder (make them first: services.gateway.keys.create_api_key); its ready file holds its URL."""
        args = ["gateway", *(extra_args if "--port" in extra_args else ["--port", "0", *extra_args])]
        if self.community is not None:
            args += ["--community", str(self.community.directory)]
        return self._spawn(f"gateway-{name}", args, wait_ready=wait_ready, member=(name, "client"), env=env)

    def start_projector(self, db_path: Path, *, wait_ready: bool = True) -> ManagedProcess:
        """`hearth projector` into `db_path`; ready once the database is migrated and both streams followed."""
        return self._spawn("projector", ["projector", "--db", str(db_path)], wait_ready=wait_ready,
                           member=("projector", "projector"))

    def metrics_urls(self) -> dict[str, str]:
        """Each running process's /metrics URL, by process name (e.g. `shard-host0-0-1`, `orchestrator-orchestrator`,
        `projector`); processes started without metrics are left out."""
        return {process.name: process.metrics_url for process in self.processes
                if process.metrics_url is not None and process.alive}

    def wait_all_ready(self) -> None:
        for process in self.processes:
            self.wait_ready(process)

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        if self.nats is not None:
            self.nats.close()
            self.nats = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
