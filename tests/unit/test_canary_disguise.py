"""A canary must not give itself away to the host it tests: it opens a session as long as the call's hop had (a
session no longer than its prompt, with no room for one decoded token, is one no call opens), naming as many kept
blocks as the hop's open did, and keeps it told
that it lives as a call's hops are (one silent for longer than a keepalive interval is no call's), and it goes only to
nodes that never saw its inputs (not the hop's, nor any mirror's, nor the node that sent the hop those inputs), so
that a liar cannot recognise replayed work and answer just that honestly. And however many ranges shards advertise,
the canaries kept stay within the library's budget."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hearth.protocol.control import PrefixBlocks
from hearth.protocol.subjects import shard_id_for
from hearth.services.common.config import TransportSettings
from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator import mirror as mirror_module
from hearth.services.orchestrator.canaries import CanaryLibrary, CanaryRunner, confirmed_canary
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.recording import ChainRecorder, HopSpan
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind, StepInfo

HIDDEN = 8
PROMPT_TOKENS = 40
MAX_TOKENS = 200
WEIGHTS = "ab" * 32
RANGE = ("m", 4, 7, "int8")


def hop_on(node: str, lo: int, hi: int) -> Hop:
    return Hop(shard_id=shard_id_for("m", lo, hi, node, quantization="int8"), control_subject=f"c.{node}",
               node_id=node, layer_lo_to_run=lo, layer_hi_to_run=hi, quantization="int8")


def mirror_on(node: str) -> SimpleNamespace:
    replica = hop_on(node, 4, 7)
    return SimpleNamespace(shard_id=replica.shard_id, dtype="float32", replica=replica)


CALL_BLOCKS = PrefixBlocks(block_tokens=16, hashes=["0123456789abcdef" * 2, "fedcba9876543210" * 2])


def checked_canary(mirror_nodes=("mirror",)):
    """What a clean check of hop 1 (layers 4-7, on node `hop`) of a three-hop chain keeps: a call of a 40-token
    prompt and up to 200 tokens, whose hops were told its two whole blocks' names, checked from position 0 over
    the prompt and 3 decoded tokens."""
    chain = SimpleNamespace(hops=[hop_on("upstream", 0, 3), hop_on("hop", 4, 7), hop_on("downstream", 8, 11)],
                            wire_dtype="auto", max_session_tokens=PROMPT_TOKENS + MAX_TOKENS, prefix=CALL_BLOCKS)
    inputs = torch.randn(1, PROMPT_TOKENS + 3, HIDDEN, generator=torch.Generator().manual_seed(3))
    span = HopSpan(1, 0, inputs, inputs * 2, (FrameKind.prefill,) * PROMPT_TOKENS + (FrameKind.decode,) * 3,
                   prompt_tokens=PROMPT_TOKENS)
    return confirmed_canary(RANGE, WEIGHTS, chain, 1, span, [mirror_on(node) for node in mirror_nodes])


class RecordingChain:
    """The replica's chain, standing in for HopChain: answers each step as the hop did."""

    opened: list["RecordingChain"] = []

    def __init__(self, nc, pipeline_id, hops, *, max_session_tokens, prefix=None, **_settings) -> None:
        self.pipeline_id = pipeline_id
        self.max_session_tokens = max_session_tokens
        self.prefix = prefix
        self.replay_steps = True
        self.sent_at: list[float] = []
        RecordingChain.opened.append(self)

    async def open(self):
        return None

    async def step(self, kind, pos, hidden, prompt_tokens=None):
        self.sent_at.append(time.monotonic())
        return hidden * 2

    async def keep_alive(self) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.fixture
def recording_chain(monkeypatch):
    RecordingChain.opened = []
    monkeypatch.setattr(mirror_module, "HopChain", RecordingChain)
    return RecordingChain


@pytest.mark.parametrize("kept_positions", [6, 256])
async def test_a_canary_opens_a_session_as_long_as_the_calls_hop_had(recording_chain, kept_positions):
    library = CanaryLibrary(per_range=2, max_positions=kept_positions)
    library.keep(checked_canary())
    [kept] = library.all()
    ctx = SimpleNamespace(nc=None, node_id="orchestrator", quarantined=set(), canaries=library, open_signer=None,
                          settings=SimpleNamespace(transport=TransportSettings(),
                                                   orchestrator=SimpleNamespace(prefill_chunk_tokens=16)))

    async def record(event) -> None:
        return None

    await CanaryRunner(ctx, record)._replay(kept, hop_on("fresh", 4, 7))
    [chain] = recording_chain.opened
    # Cut inside the prompt or not, the host is opened as the checked hop was, not as long as the prompt.
    assert chain.max_session_tokens == PROMPT_TOKENS + MAX_TOKENS
    # A call whose prompt has whole blocks names them to its hops: a canary names as many (fresh ones, which no
    # host keeps and which tell it nothing of the call's), since an open that names none would give it away.
    assert chain.prefix is not None and chain.prefix.block_tokens == CALL_BLOCKS.block_tokens
    assert len(chain.prefix.hashes) == len(CALL_BLOCKS.hashes)
    assert not set(chain.prefix.hashes) & set(CALL_BLOCKS.hashes)


def candidate(node: str, lo: int = 4, hi: int = 7) -> ShardCandidate:
    return ShardCandidate(shard_id=shard_id_for("m", lo, hi, node, quantization="int8"), model_id="m",
                          weights_sha256=WEIGHTS, node_id=node, layer_lo=lo, layer_hi=hi, total_layers=12,
                          control_subject=f"c.{node}", hop_weight=1.0, max_concurrent_streams=1, status="advertised",
                          advertised_at=0, expires_at=10, last_seen=None, queue_depth=None, active_streams=None,
                          quantization="int8", dtype="float32")


async def test_a_canary_goes_only_to_nodes_that_never_saw_its_inputs():
    canary = checked_canary(mirror_nodes=("mirror", "second-mirror"))  # a `vote` check: two mirrors saw it
    candidates = [
        candidate("hop", 0, 11),  # another shard (a wider range) of the checked hop's node
        candidate("mirror", 0, 7),  # another shard of the first mirror's node
        candidate("second-mirror"),  # the vote's second mirror: it ran these very inputs
        candidate("upstream", 0, 7),  # it computed these inputs and sent them to the hop
        candidate("fresh"),
    ]
    router = SimpleNamespace(candidates=lambda model_id: candidates, now=lambda: 0.0, alive=lambda shard, now: True)
    hosts = await CanaryRunner(SimpleNamespace(router=router, quarantined=set()), None)._hosts(canary)
    assert [hop.node_id for hop in hosts] == ["fresh"]


def test_the_canaries_of_every_range_together_stay_within_the_library_budget():
    # A member can advertise shards of many ranges, and each range a call runs keeps its own canaries.
    one = checked_canary()
    library = CanaryLibrary(per_range=4, max_positions=256, budget_bytes=3 * one.nbytes)
    for lo in range(40):
        library.keep(replace(one, key=("m", lo, lo + 3, "int8")))
    assert library.total_bytes <= 3 * one.nbytes and len(library.all()) == 3
    assert ("m", 39, 42, "int8") in {canary.key for canary in library.all()}, "the newest is kept"
    library.keep(replace(one, inputs=torch.zeros(1, 200, 64), outputs=torch.zeros(1, 200, 64)))
    assert len(library.all()) == 3, "one beyond the whole budget is not kept"


class TalkativeChain(RecordingChain):
    """A replica's chain whose host answers a step only once it heard the session's orchestrator is alive, as a
    call's hops hear every `keepalive_interval_s`: a session that runs longer with no keepalive is no call's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.told = asyncio.Event()

    async def keep_alive(self) -> None:
        self.told.set()

    async def step(self, kind, pos, hidden, prompt_tokens=None):
        try:
            await asyncio.wait_for(self.told.wait(), timeout=5.0)
        except TimeoutError:
            return StepFailure("stalled", "x", "never told the session lives")
        self.told.clear()
        return hidden * 2


async def test_a_canary_keeps_its_host_told_that_the_session_lives(monkeypatch):
    TalkativeChain.opened = []
    monkeypatch.setattr(mirror_module, "HopChain", TalkativeChain)
    library = CanaryLibrary(per_range=2, max_positions=256)
    library.keep(checked_canary())
    [kept] = library.all()
    ctx = SimpleNamespace(nc=None, node_id="orchestrator", quarantined=set(), canaries=library, open_signer=None,
                          settings=SimpleNamespace(transport=TransportSettings(keepalive_interval_s=0.01),
                                                   orchestrator=SimpleNamespace(prefill_chunk_tokens=16)))
    records = []

    async def record(event) -> None:
        records.append(event)

    await CanaryRunner(ctx, record)._replay(kept, hop_on("fresh", 4, 7))
    assert [type(event).__name__ for event in records] == ["IntegrityShardsVerified"]


async def test_a_canary_sends_each_step_no_sooner_after_its_first_than_the_call_did(recording_chain):
    # A call's hop gets its next decode step only after the rest of the chain and the sampling; a canary sending
    # them back to back would be told from one by its cadence.
    recorder = ChainRecorder(None, "p", ["hop"], link_keys=[None], sealed=False, step_limits=None)
    await recorder.start("s")
    inputs = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(9))
    steps = [(FrameKind.prefill, 0, 2), (FrameKind.decode, 2, 1), (FrameKind.decode, 3, 1), (FrameKind.decode, 4, 1)]
    for number, (kind, pos, tokens) in enumerate(steps, start=1):
        if kind is FrameKind.decode:
            await asyncio.sleep(0.05)  # the chain's other hops and the sampling, between two decode steps
        info = StepInfo(session="s", step=number, kind=kind, pos=pos,
                        prompt_tokens=2 if kind is FrameKind.prefill else None)
        recorder.sent(info, inputs[:, pos:pos + tokens])
        recorder.completed(info, inputs[:, pos:pos + tokens] * 2)
    chain = SimpleNamespace(hops=[hop_on("hop", 4, 7)], wire_dtype="auto", max_session_tokens=10, prefix=None)
    canary = confirmed_canary(RANGE, WEIGHTS, chain, 0, recorder.span(0, 0, len(steps)), [mirror_on("mirror")])
    ctx = SimpleNamespace(nc=None, node_id="orchestrator", quarantined=set(), canaries=None, open_signer=None,
                          settings=SimpleNamespace(transport=TransportSettings(),
                                                   orchestrator=SimpleNamespace(prefill_chunk_tokens=16)))

    async def record(event) -> None:
        return None

    await CanaryRunner(ctx, record)._replay(canary, hop_on("fresh", 4, 7))
    [replica] = recording_chain.opened
    assert len(replica.sent_at) == len(steps)
    # When the call's steps went out as the recorder noted them, the cadence the canary keeps (each a moment after
    # the test's own note, by however long a loaded machine takes): three decode steps 50 ms apart.
    call_sent_at = [canary.sent_at[pos] for _, pos, _ in steps]
    assert call_sent_at[-1] - call_sent_at[0] >= 0.1
    for sent, call_sent in zip(replica.sent_at, call_sent_at, strict=True):
        assert sent - replica.sent_at[0] >= call_sent - call_sent_at[0] - 1e-3
