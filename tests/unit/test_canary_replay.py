"""Canaries cut to the library's length still run as the hop ran them: the prompt length its prefill chunks were
told (a LongRoPE model rotates by it) goes with the canary, and the replica is opened for a session that long; no
canary goes to a node whose shard a check of ours just proved wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.events.models import IntegrityShardsVerified
from hearth.protocol.subjects import shard_id_for
from hearth.services.common.config import TransportSettings
from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator import mirror as mirror_module
from hearth.services.orchestrator.canaries import Canary, CanaryLibrary, CanaryRunner
from hearth.services.orchestrator.placement import ChainPlacement
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind

HIDDEN = 8
PROMPT_TOKENS = 40
KEPT_POSITIONS = 6
RECORDED_POSITIONS = PROMPT_TOKENS + 3


def recorded_canary() -> Canary:
    """A confirmed run of a hop from position 0: a 40-token prompt in one prefill step, then 3 decode steps."""
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(1, RECORDED_POSITIONS, HIDDEN, generator=generator)
    kinds = (FrameKind.prefill,) * PROMPT_TOKENS + (FrameKind.decode,) * 3
    return Canary(("m", 0, 3, "int8"), "ab" * 32, "float32", "auto", ChainPlacement(), kinds, inputs, inputs * 2,
                  ("h1", "r1"), prompt_tokens=PROMPT_TOKENS)


class RecordingChain:
    """The replica's chain, standing in for HopChain: answers each step with the canary's recorded outputs."""

    opened: list["RecordingChain"] = []

    def __init__(self, nc, pipeline_id, hops, *, max_session_tokens, **_settings) -> None:
        self.pipeline_id = pipeline_id
        self.max_session_tokens = max_session_tokens
        self.replay_steps = True
        self.steps: list[tuple[FrameKind, int, int, int | None]] = []
        RecordingChain.opened.append(self)

    async def open(self):
        return None

    async def step(self, kind, pos, hidden, prompt_tokens=None):
        self.steps.append((kind, pos, int(hidden.shape[1]), prompt_tokens))
        return hidden * 2

    async def keep_alive(self) -> None:
        return None

    async def close(self) -> None:
        return None


def test_the_library_cuts_a_canary_to_its_length_and_keeps_the_prompt_length_it_was_told():
    library = CanaryLibrary(per_range=2, max_positions=KEPT_POSITIONS)
    library.keep(recorded_canary())
    [kept] = library.all()
    assert kept.positions == KEPT_POSITIONS and len(kept.kinds) == KEPT_POSITIONS
    assert kept.prompt_tokens == PROMPT_TOKENS


@pytest.fixture
def recording_chain(monkeypatch):
    RecordingChain.opened = []
    monkeypatch.setattr(mirror_module, "HopChain", RecordingChain)
    return RecordingChain


async def test_a_cut_canary_tells_the_replica_the_whole_prompt_length_as_the_hop_was_told(recording_chain):
    library = CanaryLibrary(per_range=2, max_positions=KEPT_POSITIONS)
    library.keep(recorded_canary())
    [kept] = library.all()
    records = []

    async def record(event) -> None:
        records.append(event)

    ctx = SimpleNamespace(nc=None, node_id="orchestrator", quarantined=set(), canaries=library, open_signer=None,
                          outbox=SimpleNamespace(signing_key=None), settings=SimpleNamespace(
                              transport=TransportSettings(), orchestrator=SimpleNamespace(prefill_chunk_tokens=4)))
    host = Hop(shard_id="x", control_subject="hearth.ctl.x", node_id="x", layer_lo_to_run=0, layer_hi_to_run=3,
               quantization="int8")
    await CanaryRunner(ctx, record)._replay(kept, host)
    [chain] = recording_chain.opened
    assert chain.max_session_tokens == PROMPT_TOKENS  # a host refuses a prompt length beyond its session's
    assert chain.steps == [(FrameKind.prefill, 0, 4, PROMPT_TOKENS), (FrameKind.prefill, 4, 2, PROMPT_TOKENS)]
    [verified] = records
    assert isinstance(verified, IntegrityShardsVerified) and verified.shards[0].shard_id == "x"
    assert "x" not in ctx.quarantined


async def test_no_canary_goes_to_a_node_a_check_of_ours_just_caught():
    canary = recorded_canary()

    def host(node: str, scheme: str = "int8") -> ShardCandidate:
        return ShardCandidate(shard_id=shard_id_for("m", 0, 3, node, quantization=scheme), model_id="m",
                              weights_sha256=canary.weights_sha256, node_id=node, layer_lo=0, layer_hi=3,
                              total_layers=8, control_subject="c", hop_weight=1.0, max_concurrent_streams=1,
                              status="advertised", advertised_at=0, expires_at=10, last_seen=None, queue_depth=None,
                              active_streams=None, quantization=scheme)

    router = SimpleNamespace(candidates=lambda model_id: [host("liar"), host("honest")], now=lambda: 0.0,
                             alive=lambda shard, now: True)
    # The liar's unquantized shard was proved wrong; its int8 shard is another id on the same node.
    ctx = SimpleNamespace(router=router, quarantined={shard_id_for("m", 0, 3, "liar")})
    hosts = await CanaryRunner(ctx, None)._hosts(canary)
    assert [hop.node_id for hop in hosts] == ["honest"]
