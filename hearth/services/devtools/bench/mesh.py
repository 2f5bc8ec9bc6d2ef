"""A bench's mesh on one machine: nats-server, every layer range served by N shard processes (replicas, each on a
node of its own) and an orchestrator, started on a LocalCluster, and where the measurements find each of them."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges
from hearth.services.devtools.managed_process import ManagedProcess

# The node of a range's first replica keeps the name it had before ranges had replicas.
BENCH_NODE_PREFIX = "bench-host"
BENCH_ORCHESTRATOR_NODE = "bench-orchestrator"
cluster_ready_timeout_s = 600.0


@dataclass
class BenchMesh:
    """The started mesh: its shard processes with their hops (index of their layer range), and the orchestrator's
    /metrics URL (None with metrics off). Once ready (`wait_mesh_ready`), per shard id: its /metrics URL, hop and
    process id; the ids are the shards' own (each writes it to its ready file), scheme and all."""

    shards: list[tuple[ManagedProcess, int]]
    orchestrator_metrics_url: str | None

    def _by_shard_id(self) -> list[tuple[str, ManagedProcess, int]]:
        return [(process.ready_file.read_text().strip(), process, hop) for process, hop in self.shards]

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {shard_id: process.metrics_url for shard_id, process, _ in self._by_shard_id()
                if process.metrics_url is not None}

    @property
    def hop_of(self) -> dict[str, int]:
        return {shard_id: hop for shard_id, _, hop in self._by_shard_id()}

    @property
    def pid_of(self) -> dict[str, int]:
        return {shard_id: process.popen.pid for shard_id, process, _ in self._by_shard_id()}


def replica_node_id(hop: int, replica: int) -> str:
    """The node id of replica `replica` (0-based) of hop `hop`'s layer range: one node per replica, since a host
    serving two replicas of a range cannot check itself."""
    return f"{BENCH_NODE_PREFIX}-{hop}" if replica == 0 else f"{BENCH_NODE_PREFIX}-{hop}-r{replica}"


def one_caller_streams_env(max_streams: int) -> dict[str, str]:
    """Settings under which one caller (a bench: a roster member on a secure mesh) runs `max_streams` calls at once.
    A member never holds every running place (hearth/services/orchestrator/queue.py), so the orchestrator has one
    place more than the bench's streams; with as many, the last of N concurrent sessions waited for another to end."""
    return {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__MAX_CONCURRENT_PIPELINES": str(max_streams + 1),
            "HEARTH_ORCHESTRATOR__MAX_STREAMS_PER_CALLER": str(max_streams)}


def one_caller_shard_args(max_streams: int) -> list[str]:
    """A shard's arguments under which one caller's orchestrator opens `max_streams` hops on it at once: on a
    community mesh one opener never holds every stream (`[shard] max_hops_per_opener`), so a shard has one more."""
    return ["--max-streams", str(max_streams + 1)]


def bench_cluster_env(max_streams: int, *, secure: bool, child_env: dict[str, str]) -> dict[str, str]:
    """The environment of a bench's processes: the bench is one caller and may run `max_streams` calls at once (an
    open mesh also drops activation MACs). Its rounds repeat one prompt, which kept prefixes would serve from the
    second round on: every call prefills whole here (scripts/bench_conversation.py measures them)."""
    return {**one_caller_streams_env(max_streams), "HEARTH_PREFIX_CACHE__ENABLED": "false",
            **({} if secure else {"HEARTH_TRANSPORT__ACTIVATION_MACS": "false"}), **child_env}


def replica_cores(replica: int, cores_per_replica: int | None) -> list[int] | None:
    """The cores replica `replica`'s shard processes are pinned to (None: not pinned): its own `cores_per_replica`,
    as if each replica of a range were on a machine of its own."""
    if cores_per_replica is None:
        return None
    return list(range(replica * cores_per_replica, (replica + 1) * cores_per_replica))


def start_bench_mesh(cluster: LocalCluster, model, *, shards: int, replicas: int, max_streams: int,
                     step_timeout_s: float, placement_args: list[str],
                     cores_per_replica: int | None = None) -> BenchMesh:
    """Start NATS, `replicas` shard processes per layer range (the layers split evenly over `shards` ranges; with
    `cores_per_replica`, the shards of each replica pinned to cores of their own) and an orchestrator preloading
    `model`, without waiting for them (`wait_mesh_ready`)."""
    ranges = even_layer_ranges(model.num_layers, shards)
    copies = f" x {replicas} replicas" if replicas > 1 else ""
    print(f"starting nats-server, {len(ranges)}{copies} shard hosts ({ranges}) and an orchestrator ...",
          file=sys.stderr, flush=True)
    cluster.start_nats()
    shard_processes = []
    for replica in range(replicas):
        for hop, (lo, hi) in enumerate(ranges):
            node_id = replica_node_id(hop, replica)
            process = cluster.start_shard(str(model.path), lo, hi, node_id=node_id, wait_ready=False,
                                          extra_args=[*one_caller_shard_args(max_streams), *placement_args],
                                          cpus=replica_cores(replica, cores_per_replica))
            shard_processes.append((process, hop))
    orchestrator = cluster.start_orchestrator(node_id=BENCH_ORCHESTRATOR_NODE, wait_ready=False, extra_args=[
        "--preload", str(model.path), "--step-timeout-s", str(step_timeout_s), *placement_args])
    return BenchMesh(shard_processes, orchestrator.metrics_url)


def wait_mesh_ready(cluster: LocalCluster) -> None:
    """Wait until every process the cluster started says it is ready."""
    for process in cluster.processes:
        cluster.wait_ready(process, timeout_s=cluster_ready_timeout_s)
    print("all processes ready", file=sys.stderr, flush=True)
