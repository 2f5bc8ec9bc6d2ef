"""The soak's fault injector: a seeded schedule of faults (shard hosts killed, frozen or restarted, an orchestrator
restarted, a household link cut, a NATS node restarted), one at a time, each healed before the next begins."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from hearth.services.broker.connection import connect_nats
from hearth.services.devtools.soak_mesh import SoakMesh

FAULT_KINDS = ("kill_shard", "freeze_shard", "restart_shard", "restart_orchestrator", "cut_link", "restart_nats")
# How long a fault holds before it is healed (seconds, drawn uniformly), and the quiet between two faults.
fault_hold_s = (2.0, 6.0)
quiet_between_faults_s = (4.0, 10.0)
# After a shard host is back, the orchestrators must hear it advertise before it counts as healed.
readvertise_wait_s = 3.0
fault_heal_timeout_s = 180.0


@dataclass
class Fault:
    """One injected fault: what, on which process, and when (seconds since the soak began) it began and healed."""

    kind: str
    target: str
    started_s: float
    healed_s: float | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class FaultInjector:
    """Runs `run(until)`: a fault, its healing, a quiet gap, and again, until `until` (a monotonic instant)."""

    def __init__(self, mesh: SoakMesh, seed: int, began_at: float, log: Callable[[str], None] = print) -> None:
        self.mesh = mesh
        self.random = random.Random(seed)
        self.began_at = began_at
        self.log = log
        self.kinds = [kind for kind in FAULT_KINDS if kind != "cut_link" or mesh.bed is not None]
        self.faults: list[Fault] = []
        self._cycle: list[str] = []

    def _now(self) -> float:
        return time.monotonic() - self.began_at

    def _next_kind(self) -> str:
        # Every kind once per shuffled round, so a short soak still meets each of them.
        if not self._cycle:
            self._cycle = self.random.sample(self.kinds, len(self.kinds))
        return self._cycle.pop()

    async def run(self, until: float) -> None:
        await asyncio.sleep(min(self.random.uniform(*quiet_between_faults_s), max(0.0, until - time.monotonic())))
        while time.monotonic() < until:
            kind = self._next_kind()
            hold_s = self.random.uniform(*fault_hold_s)
            fault = await self._inject(kind, hold_s)
            self.log(f"fault {fault.kind} on {fault.target}: {fault.started_s:.1f}-{fault.healed_s or -1:.1f} s"
                     + (f" ({fault.error})" if fault.error else ""))
            await asyncio.sleep(min(self.random.uniform(*quiet_between_faults_s), max(0.0, until - time.monotonic())))

    async def _inject(self, kind: str, hold_s: float) -> Fault:
        action = getattr(self, f"_{kind}")
        target_name, begin, heal = action()
        fault = Fault(kind, target_name, self._now())
        self.faults.append(fault)
        try:
            async with asyncio.timeout(fault_heal_timeout_s):
                await asyncio.to_thread(begin)
            await asyncio.sleep(hold_s)
            async with asyncio.timeout(fault_heal_timeout_s):
                await heal()
        except Exception as error:  # recorded in the report: a fault that could not be healed fails the soak
            fault.error = f"{type(error).__name__}: {error}"
        fault.healed_s = self._now()
        return fault

    # Each returns (target name, begin (blocking), heal (a coroutine function)).

    def _shard(self):
        return self.random.choice(self.mesh.shards)

    def _kill_shard(self):
        slot = self._shard()
        return slot.node_id, lambda: slot.process.signal(signal.SIGKILL), lambda: self._restart_shard_slot(slot)

    def _freeze_shard(self):
        slot = self._shard()

        async def thaw() -> None:
            slot.process.signal(signal.SIGCONT)

        return slot.node_id, lambda: slot.process.signal(signal.SIGSTOP), thaw

    def _restart_shard(self):
        slot = self._shard()
        return slot.node_id, lambda: slot.process.stop(), lambda: self._restart_shard_slot(slot)

    async def _restart_shard_slot(self, slot) -> None:
        await asyncio.to_thread(slot.process.stop)  # reaps a killed one
        await asyncio.to_thread(self.mesh.start_shard, slot)
        await asyncio.sleep(readvertise_wait_s)

    def _restart_orchestrator(self):
        node_id = self.random.choice(sorted(self.mesh.orchestrators))

        async def start_again() -> None:
            await asyncio.to_thread(self.mesh.start_orchestrator, node_id)

        return node_id, lambda: self.mesh.orchestrators[node_id].stop(), start_again

    def _cut_link(self):
        slot = self._shard()

        async def heal() -> None:
            await asyncio.to_thread(self.mesh.bed.heal, slot.household)

        return f"{slot.node_id}'s link", lambda: self.mesh.bed.cut(slot.household), heal

    def _restart_nats(self):
        node = self.random.choice(self.mesh.nats.nodes)

        async def start_again() -> None:
            await asyncio.to_thread(self.mesh.restart_nats_node, node)
            await wait_streams_current(self.mesh, node.name)

        return node.name, lambda: node.stop(kill=True), start_again


async def wait_streams_current(mesh: SoakMesh, node_name: str, timeout_s: float = fault_heal_timeout_s) -> None:
    """Every event stream lists `node_name` among its peers and every peer is current: the node caught up."""
    from tests.e2e.test_nats_cluster_kill import wait_caught_up  # the e2e tests' own check, reused

    nc = await connect_nats(mesh.cluster.nats_url, name="soak-faults", settings=mesh.cluster.nats_settings())
    try:
        node = next(node for node in mesh.nats.nodes if node.name == node_name)
        async with asyncio.timeout(timeout_s):
            await wait_caught_up(nc.jetstream(), node)
    finally:
        async with asyncio.timeout(5):
            await nc.close()
