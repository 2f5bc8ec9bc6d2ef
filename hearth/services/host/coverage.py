"""How many live replicas of a model's weights hold each layer, as a `hearth host` reads them from its own read model
with the routing rules' idea of a live shard (hearth/services/orchestrator/router.py): the coverage its choices are
made on (hearth/services/host/planner.py), where it stands in turn among the hosts holding its layers, whether
another host's move is under way, and which of its own node's earlier shards no longer answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Set
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from hearth.events.streams import SHARDS_STREAM
from hearth.readmodels.queries import ShardCandidate, coverage_text
from hearth.readmodels.retention import retention_policy
from hearth.readmodels.runner import Projector
from hearth.readmodels.scratch_model import ScratchReadModel
from hearth.services.common.config import HearthSettings
from hearth.services.common.event_trust import event_verifier, stream_setup
from hearth.services.host.planner import LayerRange, replicas_per_layer
from hearth.services.orchestrator.router import ShardRouter
from hearth.services.transport.probe import ProbeOutcome, probe_outcome

log = logging.getLogger(__name__)

COVERAGE_FILE = "coverage.sqlite"
# The reason a host's withdrawal gives when it leaves a range to move to another (what other hosts wait for).
MOVED = "moved"


class CoverageReader:
    """How many live replicas hold each layer of one model, read through `router` (the routing rules' idea of a
    live shard) after `catch_up` (waiting for the read model to reach the event log's end) when given."""

    def __init__(self, router: ShardRouter, *, model_id: str, weights_sha256: str, total_layers: int,
                 catch_up: Callable[[], Awaitable[object]] | None = None, quantization: str = "none") -> None:
        self.router, self.catch_up = router, catch_up
        self.model_id, self.weights_sha256, self.total_layers = model_id, weights_sha256, total_layers
        self.quantization = quantization

    async def replicas(self, leave_out: Set[str] = frozenset()) -> list[int]:
        shards, alive = await self._live_shards()
        return replicas_per_layer(shards, total_layers=self.total_layers, weights_sha256=self.weights_sha256,
                                  alive=alive, leave_out=leave_out, quantization=self.quantization)

    async def unanswering_shards_of(self, node_id: str,
                                    answers: Callable[[ShardCandidate], Awaitable[bool]]) -> frozenset[str]:
        """The shards of `node_id` that replicas() counts but that do not `answers` (are not served any more): a
        crashed run's, whose advert lives on until the health timeout. A node may run other processes, whose
        shards answer and stay counted."""
        shards, alive = await self._live_shards()
        mine = [shard for shard in shards if shard.node_id == node_id and self._counted(shard, alive)]
        answered = await asyncio.gather(*(answers(shard) for shard in mine))
        return frozenset(shard.shard_id for shard, answer in zip(mine, answered) if not answer)

    async def turn(self, current: LayerRange, shard_id: str) -> int:
        """This host's place among the live hosts holding any of `current`'s layers (0: first), in shard-id order:
        hosts that could all leave the same layers move one after another (wait_for_hole), never together."""
        shards, alive = await self._live_shards()
        return sum(1 for shard in shards
                   if shard.shard_id < shard_id and self._counted(shard, alive)
                   and shard.layer_lo <= current.hi and current.lo <= shard.layer_hi)

    async def move_under_way(self, within_s: float) -> bool:
        """Whether a host is moving: it withdrew a range of these weights and scheme as MOVED under `within_s` ago,
        its node has advertised no other range since (it drains, then loads the new one, a hole until then), and it
        is still heard from: the moving host heartbeats the range it left until the new one is advertised
        (host.moving.heartbeats_while_moving), so one killed mid-move holds the others back for the health timeout,
        as a killed host's range does, not for `within_s`."""
        shards, _ = await self._live_shards()
        now = self.router.now()
        ours = [shard for shard in shards
                if shard.weights_sha256 == self.weights_sha256 and shard.quantization == self.quantization]

        def landed(moved: ShardCandidate) -> bool:
            return any(shard.node_id == moved.node_id and shard.shard_id != moved.shard_id
                       and shard.advertised_at >= moved.withdrawn_at for shard in ours)

        def heard_from(moved: ShardCandidate) -> bool:
            return now - max(moved.withdrawn_at, moved.last_seen or 0) <= self.router.health_timeout_s

        return any(shard.withdrawn_reason == MOVED and shard.withdrawn_at is not None
                   and now - shard.withdrawn_at < within_s and not landed(shard) and heard_from(shard)
                   for shard in ours)

    async def other_schemes(self) -> dict[str, list[int]]:
        """The live replicas of each layer of these weights under each other quantization scheme than this host's:
        layers a pipeline of this host's scheme cannot use (it never mixes schemes), however well they are served."""
        shards, alive = await self._live_shards()
        schemes = sorted({shard.quantization for shard in shards if shard.weights_sha256 == self.weights_sha256
                          and shard.quantization != self.quantization and alive(shard)})
        return {scheme: replicas_per_layer(shards, total_layers=self.total_layers, weights_sha256=self.weights_sha256,
                                           alive=alive, quantization=scheme) for scheme in schemes}

    async def live_ranges(self) -> list[str]:
        """`node lo-hi` of each live shard counted in replicas(), for an operator to read."""
        shards, alive = await self._live_shards()
        return sorted({f"{shard.node_id} {shard.layer_lo}-{shard.layer_hi}" for shard in shards
                       if self._counted(shard, alive)})

    def _counted(self, shard: ShardCandidate, alive: Callable[[ShardCandidate], bool]) -> bool:
        return (shard.weights_sha256 == self.weights_sha256 and shard.quantization == self.quantization
                and alive(shard))

    async def _live_shards(self) -> tuple[list[ShardCandidate], Callable[[ShardCandidate], bool]]:
        if self.catch_up is not None:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await self.catch_up()
        shards = await asyncio.to_thread(self.router.candidates, self.model_id)
        now = self.router.now()
        return shards, lambda shard: self.router.alive(shard, now)


class HoleWithoutMove:
    """Says once per hole (the layers no live replica holds) that it has lasted `after_s` with no move of the host
    serving `current` as `shard_id` into it or toward it, naming the hole and the hosts' live ranges: the operator's
    cue where the moves stop short of a cover (layers of unequal sizes, whose cover may need two hosts to trade
    places, which no move made one at a time without dropping a last replica reaches)."""

    def __init__(self, coverage: CoverageReader, shard_id: str, current: LayerRange, after_s: float) -> None:
        self.coverage, self.shard_id, self.current, self.after_s = coverage, shard_id, current, after_s
        self.hole: tuple[int, ...] = ()
        self.since = 0.0
        self.said = False

    async def seen(self, replicas_without_me: list[int], now: float) -> None:
        """Note what a check found (no move for this host) in `replicas_without_me` at `now` (time.monotonic)."""
        hole = tuple(layer for layer, count in enumerate(replicas_without_me)
                     if count == 0 and layer not in self.current.layers())
        if hole != self.hole:
            self.hole, self.since, self.said = hole, now, False
        if not hole or self.said or now - self.since < self.after_s:
            return
        self.said = True
        ranges = await self.coverage.live_ranges()
        mine = [count + (layer in self.current.layers()) for layer, count in enumerate(replicas_without_me)]
        log.warning("host of %s: coverage of %s has a hole that no move of this host (layers %s) fills or nears, "
                    "for %.0f s now: "
                    "%s; live ranges: %s. Its cover may need hosts to trade places, which moves that never drop a "
                    "layer's last replica cannot reach: start a host whose budget fits the hole, or restart one of "
                    "these hosts", self.shard_id, self.coverage.model_id, self.current, now - self.since,
                    coverage_text(enumerate(mine)), "; ".join(ranges) or "none")


def coverage_model(folder: Path, js: JetStreamContext, settings: HearthSettings) -> ScratchReadModel:
    """The host's own read model of the shard events, on a scratch file in `folder` (what its coverage is read from;
    nobody else reads it, so SQLite finding it damaged rebuilds it: hearth/readmodels/scratch_model.py)."""
    def new_projector(path: Path) -> Projector:
        return Projector(path, js, streams=(SHARDS_STREAM,), retention=retention_policy(settings.readmodels),
                         verifier=event_verifier(settings), stream_setup=stream_setup(settings.nats))

    return ScratchReadModel(folder, new_projector, file_name=COVERAGE_FILE, owner="host",
                            what="coverage read model",
                            rebuild_catch_up_s=settings.orchestrator.start_catch_up_timeout_s)


def coverage_from(model_view: ScratchReadModel, settings: HearthSettings, node_id: str, **model) -> CoverageReader:
    """A CoverageReader over this host's own read model (started)."""
    router = ShardRouter(model_view.session_factory, allow_self_as_shard=True, self_node_id=node_id,
                         health_timeout_s=settings.research.distributed_inference.shard_health_timeout_s,
                         silent_log_grace_s=settings.research.distributed_inference.silent_log_grace_s,
                         read_model_version=lambda: model_view.batches_total)
    timeout_s = settings.orchestrator.catch_up_timeout_s
    return CoverageReader(router, catch_up=lambda: model_view.wait_until_caught_up(timeout_s=timeout_s), **model)


async def earlier_shards_gone(coverage: CoverageReader, nc: NatsClient, node: str,
                              settings: HearthSettings) -> frozenset[str]:
    """This node's shards in `coverage` whose control subject has no responder or stays silent to `stat`: what a
    crashed run of this host left advertised, which its first choice must not take for a replica."""
    timeout_s = settings.transport.probe_timeout_s

    async def answers(shard: ShardCandidate) -> bool:
        return await probe_outcome(nc, shard, timeout_s) is ProbeOutcome.answered

    gone = await coverage.unanswering_shards_of(node, answers)
    if gone:
        log.info("host %s: not counting its earlier shards that no longer answer: %s", node, ", ".join(sorted(gone)))
    return gone


async def warn_of_other_schemes(coverage: CoverageReader, node: str) -> None:
    """Say which layers the mesh serves in other schemes than this host's: they do not count toward its coverage (a
    pipeline never mixes schemes), so hosts of one household started with different `--quantize` each cover the model
    in their own scheme, and together perhaps in none."""
    for scheme, replicas in (await coverage.other_schemes()).items():
        log.warning("host %s: the mesh also serves %s in %s (%s), which this host's %s pipelines cannot use: start "
                    "every host of the model with the same --quantize to pool their layers", node, coverage.model_id,
                    scheme, coverage_text(enumerate(replicas)), coverage.quantization)
