"""The soak's mesh: a three-node NATS cluster, two orchestrators, two replicas per layer range and a projector, in
a household test bed where one can be made (hearth/services/devtools/netbed.py), and the means to restart each part.

With a bed: NATS node 0, the orchestrators and the projector in the hub, nodes 1 and 2 in households 0 and 1, each
shard host in a household of its own (so its link can be cut). Without one (not root, no iproute2): everything on
loopback, and the soak leaves link cuts out of its schedule. Processes are fresh `python -m hearth.services.cli` runs
(the prefork launcher's forks could not change namespace), so a restart is a real start."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from hearth.services.broker.cluster import ClusterNodeServer, EmbeddedNatsCluster
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.devtools.managed_process import ManagedProcess
from hearth.services.devtools.netbed import NetBed

# The tiny model's six layers as two ranges, each served by two replicas (shard hosts s<range><replica>).
LAYER_RANGES = ((0, 2), (3, 5))
REPLICAS_PER_RANGE = 2
ORCHESTRATOR_IDS = ("orch-a", "orch-b")
NATS_NODES = 3
# Node i's household (None: the hub); in a bed every node listens on the same ports at an address of its own.
NATS_NODE_HOUSEHOLDS = (None, 0, 1)
NATS_CLIENT_PORT, NATS_CLUSTER_PORT, NATS_MONITOR_PORT = 4222, 6222, 8222
# Shard hosts heartbeat at their default interval: HEARTH_SHARDS keeps at most max_msgs_per_subject events per
# subject (hearth/events/streams.py), and faster beats would have it trim a long soak's oldest ones sooner; the
# lost-event check reads those gaps against the limit (tests/e2e/event_log_checks.py), but cannot tell a loss below them
# from trimming. Advertisements are renewed every ttl/3, so a restarted host is routed with soon; health times out after
# several missed beats, as a loaded machine delays some.
SHARD_TTL_S = 6.0
SHARD_HEALTH_TIMEOUT_S = 10.0
# A step timeout that a loaded two-core machine does not trip on every step.
ORCHESTRATOR_STEP_TIMEOUT_S = 2.0


@dataclass
class ShardSlot:
    """One shard host's place in the mesh: its node id, layers and household; `process` is its current run."""

    node_id: str
    lo: int
    hi: int
    household: int | None
    process: ManagedProcess | None = None


@dataclass
class SoakMesh:
    """The running mesh; `close()` stops every process and removes the bed."""

    work_dir: Path
    model_path: Path
    bed: NetBed | None = None
    cluster: LocalCluster | None = None
    shards: list[ShardSlot] = field(default_factory=list)
    orchestrators: dict[str, ManagedProcess] = field(default_factory=dict)
    projector: ManagedProcess | None = None
    projector_db: Path | None = None
    _exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def nats(self) -> EmbeddedNatsCluster:
        return self.cluster.nats

    def node_place(self, index: int):
        household = NATS_NODE_HOUSEHOLDS[index]
        return self.bed.hub if household is None else self.bed.households[household]

    def start(self, use_bed: bool) -> None:
        """Build the bed (with `use_bed`) and start every process; the caller closes the mesh, failed or not (so a
        failed start's logs can be read first)."""
        shard_households = len(LAYER_RANGES) * REPLICAS_PER_RANGE
        if use_bed:
            self.bed = self._exits.enter_context(NetBed(households=len(NATS_NODE_HOUSEHOLDS) - 1 + shard_households))
            # This thread (the soak's event loop's) and every thread it starts from now on live in the hub.
            self._exits.enter_context(self.bed.entered(self.bed.hub))
        node_addresses = ([self.node_place(index).address for index in range(NATS_NODES)] if self.bed
                          else ["127.0.0.1"] * NATS_NODES)
        self.cluster = self._exits.enter_context(LocalCluster(
            work_dir=self.work_dir / "cluster", torch_threads=1, tls=self.bed is not None,
            tls_host_names=tuple(node_addresses) if self.bed else ("localhost", "127.0.0.1"), prefork=False,
            metrics=False, extra_env={"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_S":
                                      str(SHARD_HEALTH_TIMEOUT_S)}))
        if self.bed:
            self.cluster.start_nats(cluster_size=NATS_NODES, node_hosts=node_addresses,
                                    ports=[NATS_CLIENT_PORT] * NATS_NODES,
                                    cluster_ports=[NATS_CLUSTER_PORT] * NATS_NODES,
                                    monitor_ports=[NATS_MONITOR_PORT] * NATS_NODES,
                                    start_in=lambda index: self.bed.entered(self.node_place(index)))
        else:
            self.cluster.start_nats(cluster_size=NATS_NODES)
        household = len(NATS_NODE_HOUSEHOLDS) - 1
        for range_index, (lo, hi) in enumerate(LAYER_RANGES):
            for replica in range(REPLICAS_PER_RANGE):
                self.shards.append(ShardSlot(f"s{range_index}{replica}", lo, hi, household if self.bed else None))
                household += 1
        for slot in self.shards:
            self.start_shard(slot, wait_ready=False)
        for node_id in ORCHESTRATOR_IDS:
            self.start_orchestrator(node_id, wait_ready=False)
        self.projector_db = self.work_dir / "projector.sqlite"
        self.projector = self.cluster.start_projector(self.projector_db, wait_ready=False)
        self.cluster.wait_all_ready()

    def _prefix(self, household: int | None) -> list[str]:
        if self.bed is None:
            return []
        return (self.bed.hub if household is None else self.bed.households[household]).exec_prefix()

    def start_shard(self, slot: ShardSlot, *, wait_ready: bool = True) -> ManagedProcess:
        slot.process = self.cluster.start_shard(
            str(self.model_path), slot.lo, slot.hi, node_id=slot.node_id, wait_ready=wait_ready,
            command_prefix=self._prefix(slot.household),
            extra_args=["--ttl-s", str(SHARD_TTL_S)])
        return slot.process

    def start_orchestrator(self, node_id: str, *, wait_ready: bool = True) -> ManagedProcess:
        self.orchestrators[node_id] = self.cluster.start_orchestrator(
            node_id=node_id, wait_ready=wait_ready, command_prefix=self._prefix(None),
            extra_args=["--preload", str(self.model_path), "--step-timeout-s", str(ORCHESTRATOR_STEP_TIMEOUT_S)])
        return self.orchestrators[node_id]

    def restart_nats_node(self, node: ClusterNodeServer) -> None:
        """Start a stopped node again (in its household) and wait until it rejoined the cluster."""
        index = self.nats.nodes.index(node)
        with self.nats.start_in(index):
            node.start()
        node.wait_healthy()

    def long_lived(self) -> dict[str, int]:
        """The pid of each process of the mesh that is running now, by name (NATS nodes, orchestrators, shard hosts,
        projector)."""
        running = {node.name: node.pid for node in self.nats.nodes if node.is_running()}
        for process in [*self.orchestrators.values(), *(slot.process for slot in self.shards), self.projector]:
            if process is not None and process.alive:
                running[process.name] = process.popen.pid
        return running

    def log_tails(self, chars: int = 3000) -> str:
        if self.cluster is None:
            return ""
        return "\n".join(f"----- {process.name} -----\n{process.log_tail(chars)}" for process in self.cluster.processes)

    def close(self) -> None:
        """Stop every process (newest first) and remove the bed; safe to call twice."""
        self._exits.close()
