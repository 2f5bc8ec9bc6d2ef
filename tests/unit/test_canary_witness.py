"""A host that answers a canary otherwise than its two parties agreed is quarantined only when a third host (a
witness, on a node that never saw the work either) answers as the parties did, or when there is no third host:
two colluding hosts that agreed on a lie as a call's hop and its mirror would otherwise have their lie kept as a
canary and every honest host it is replayed to quarantined. A witness that answers as the host did drops the
canary, and the disagreement blames nobody."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.events.models import IntegrityMismatchConfirmed, IntegrityMismatchDisputed
from hearth.protocol.subjects import shard_id_for
from hearth.services.common.config import TransportSettings
from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator import mirror as mirror_module
from hearth.services.orchestrator.canaries import Canary, CanaryLibrary, CanaryRunner
from hearth.services.orchestrator.placement import ChainPlacement
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind

HIDDEN = 8
POSITIONS = 6
WEIGHTS = "ab" * 32
RANGE = ("m", 4, 7, "int8")
# What each host computes: honest hosts double their input, liars (and their colluders) add a lie to it.
LIARS = {"liar", "colluder"}


def shard(node: str) -> str:
    return shard_id_for("m", 4, 7, node, quantization="int8")


def computed_by(node: str, inputs: torch.Tensor) -> torch.Tensor:
    return inputs * 2 + (5.0 if node in LIARS else 0.0)


class HostChain:
    """The replica's chain, standing in for HopChain: its host computes as `computed_by` says."""

    def __init__(self, nc, pipeline_id, hops, **_settings) -> None:
        self.pipeline_id = pipeline_id
        self.node = hops[0].node_id
        self.replay_steps = True

    async def open(self):
        return None

    async def step(self, kind, pos, hidden, prompt_tokens=None):
        return computed_by(self.node, hidden)

    async def keep_alive(self) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.fixture(autouse=True)
def host_chains(monkeypatch):
    monkeypatch.setattr(mirror_module, "HopChain", HostChain)


def canary_of(parties: tuple[str, str]) -> Canary:
    """Work the hosts on `parties` (nodes) agreed on as a call's hop and its mirror."""
    inputs = torch.randn(1, POSITIONS, HIDDEN, generator=torch.Generator().manual_seed(7))
    return Canary(RANGE, WEIGHTS, "float32", "auto", ChainPlacement(), (FrameKind.prefill,) * POSITIONS, inputs,
                  computed_by(parties[0], inputs), tuple(shard(node) for node in parties), POSITIONS,
                  seen_by_nodes=frozenset(parties))


def candidate(node: str) -> ShardCandidate:
    return ShardCandidate(shard_id=shard(node), model_id="m", weights_sha256=WEIGHTS, node_id=node, layer_lo=4,
                          layer_hi=7, total_layers=12, control_subject=f"c.{node}", hop_weight=1.0,
                          max_concurrent_streams=1, status="advertised", advertised_at=0, expires_at=10,
                          last_seen=None, queue_depth=None, active_streams=None, quantization="int8", dtype="float32")


def runner_with(canary: Canary, nodes: list[str]) -> tuple[CanaryRunner, SimpleNamespace, list]:
    library = CanaryLibrary(per_range=4, max_positions=POSITIONS)
    library.keep(canary)
    quarantined: set[str] = set()
    records: list = []

    async def record(event) -> None:
        records.append(event)

    router = SimpleNamespace(candidates=lambda model_id: [candidate(node) for node in nodes], now=lambda: 0.0,
                             alive=lambda shard, now: True)
    ctx = SimpleNamespace(nc=None, node_id="orchestrator", quarantined=quarantined, prove_wrong=quarantined.add,
                          canaries=library, open_signer=None, router=router,
                          settings=SimpleNamespace(transport=TransportSettings(),
                                                   orchestrator=SimpleNamespace(prefill_chunk_tokens=4)))
    return CanaryRunner(ctx, record), ctx, records


def host_on(node: str) -> Hop:
    return Hop(shard_id=shard(node), control_subject=f"c.{node}", node_id=node, layer_lo_to_run=4,
               layer_hi_to_run=7, quantization="int8")


async def test_two_colluders_canary_gets_no_honest_host_quarantined_where_a_witness_answers():
    runner, ctx, records = runner_with(canary_of(("liar", "colluder")), ["liar", "colluder", "honest", "witness"])
    ctx.canaries.keep(canary_of(("a", "b")))  # an honest canary of the same range stays
    poisoned, honest = ctx.canaries.all()
    await runner._replay(poisoned, host_on("honest"))
    assert not ctx.quarantined
    assert not any(isinstance(event, IntegrityMismatchConfirmed) for event in records)
    [disputed] = [event for event in records if isinstance(event, IntegrityMismatchDisputed)]
    assert set(disputed.shard_ids) == {shard("honest"), shard("liar")}
    assert ctx.canaries.all() == [honest], "a canary a witness contradicts is replayed to nobody else"


async def test_a_liar_answering_a_canary_is_quarantined_when_a_witness_answers_as_the_parties_did():
    runner, ctx, records = runner_with(canary_of(("a", "b")), ["a", "b", "liar", "witness"])
    [kept] = ctx.canaries.all()
    await runner._replay(kept, host_on("liar"))
    assert ctx.quarantined == {shard("liar")}
    [confirmed] = [event for event in records if isinstance(event, IntegrityMismatchConfirmed)]
    assert confirmed.shard_id == shard("liar")
    assert set(confirmed.witnesses) == {shard("a"), shard("b"), shard("witness")}


async def test_with_no_third_host_the_canarys_two_parties_settle_it_as_before():
    runner, ctx, records = runner_with(canary_of(("a", "b")), ["a", "b", "liar"])
    [kept] = ctx.canaries.all()
    await runner._replay(kept, host_on("liar"))
    assert ctx.quarantined == {shard("liar")}
