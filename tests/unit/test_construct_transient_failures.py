"""Unit tests of what a chain's construction rides through: shards silent to their open ("no responders": one more
try after `[orchestrator] silent_shard_recheck_s` before the call is answered shard_unavailable), and our own broker
connection failing under the open's subscriptions (a `broker` failure, and the construction goes on once it is back);
and what a check of ours just proved wrong is out at once, with every other shard of its node."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from hearth.services.common.config import HearthSettings, NatsSettings, TransportSettings
from hearth.services.common.config_processes import OrchestratorSettings
from nats.errors import FlushTimeoutError

from hearth.services.orchestrator.answer_kv import AnswerWarmUps
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.construct import ChainBuilder
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.prefix import KeptChains
from hearth.services.orchestrator.router import Hop, RoutingError, ShardRouter
from hearth.services.orchestrator.verification import CallVerifier
from tests.readmodel_helpers import (
    MODEL_INFO,
    MODEL_ID,
    WEIGHTS_SHA,
    LogBuilder,
    advertised,
    apply_all,
    at,
    heartbeat,
    migrated_engine,
)


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    log = LogBuilder()
    only = advertised(0, 7, "only")  # the one shard of the model: no replica to route to
    apply_all(engine, [log.stored(only), log.stored(heartbeat(only.shard_id))])
    yield engine
    engine.dispose()


# What a shard answers an open signed by an orchestrator whose clock is off the shard's (shard/server.py).
STALE_OPEN = ("refused: unauthorized: the open is not signed by a member (stale): the open's timestamp is 95 s from "
              "this shard's clock (at most 30 s allowed)")


class ChainStub:
    """A chain whose open fails the first `failing_opens` times: its hop silent, or (`kind` broker) our broker."""

    def __init__(self, hops, opens: list, failing_opens: int, kind: str) -> None:
        self.hops = hops
        self._opens = opens
        self._failing_opens = failing_opens
        self._kind = kind

    async def open(self) -> StepFailure | None:
        self._opens.append(self.hops[0].shard_id)
        if len(self._opens) > self._failing_opens:
            return None
        if self._kind == "broker":
            return StepFailure("broker", None, "subscribing: nats: flush timeout")
        if self._kind == "unauthorized":
            return StepFailure("refused", self.hops[0].shard_id, STALE_OPEN, code="unauthorized")
        return StepFailure("gone", self.hops[0].shard_id, "no responder on its control subject")

    async def close(self) -> None:
        pass


class Builder(ChainBuilder):
    """ChainBuilder over ChainStub chains."""

    def __init__(self, call, ctx, failing_opens: int, kind: str) -> None:
        super().__init__(call, ctx)
        self.opens: list[str] = []
        self.failing = (failing_opens, kind)

    def over(self, hops):
        return ChainStub(hops, self.opens, *self.failing)

def builder(engine, failing_opens: int, kind: str = "gone") -> Builder:
    sessions = sessionmaker(engine)

    async def caught_up(timeout_s: float) -> dict:
        return {}

    settings = HearthSettings(orchestrator=OrchestratorSettings(silent_shard_recheck_s=0.01),
                              nats=NatsSettings(reconnect_wait_s=0.01))
    router = ShardRouter(sessions, health_timeout_s=60, allow_self_as_shard=True, self_node_id="orch",
                         clock=lambda: at(5).timestamp())
    ctx = RunContext(nc=SimpleNamespace(is_connected=True), node_id="orch", settings=settings, router=router,
                     projector=SimpleNamespace(session_factory=sessions, wait_until_caught_up=caught_up), catalog=None,
                     outbox=SimpleNamespace(signing_key=None), recent_failures=SimpleNamespace(current=lambda: set()),
                     head_steps=None, sink_bounds={}, load=ShardLoad(retry_s=1.0), guards=None, canaries=None,
                     kept_chains=KeptChains(), warm_ups=AnswerWarmUps())
    call = SimpleNamespace(model=SimpleNamespace(model_id=MODEL_ID, weights_sha256=WEIGHTS_SHA,
                                                 head=SimpleNamespace(rope_switch_tokens=None, info=MODEL_INFO)),
                           caller=None,
                           pipeline_id="p-1", request=SimpleNamespace(params=SimpleNamespace(verify="sampled"),
                                                                     max_tokens=4),
                           known_ids=[1, 2, 3], prompt_ids=[1, 2, 3], quantization=None, excluded={})
    return Builder(call, ctx, failing_opens, kind)


async def test_a_shard_silent_once_is_tried_again_before_the_call_is_unavailable(engine):
    build = builder(engine, failing_opens=1)
    chain = await build.build()
    assert build.opens == [chain.hops[0].shard_id] * 2
    assert build.call.excluded == {}


async def test_a_shard_still_silent_after_the_pause_makes_the_call_unavailable(engine):
    build = builder(engine, failing_opens=10)
    with pytest.raises(RoutingError) as error:
        await build.build()
    assert error.value.code == "shard_unavailable"
    assert len(build.opens) == 2  # one more try, not a loop
    assert build.call.excluded.keys() == {f"{MODEL_ID}:0-7@only"}


async def test_a_shard_our_check_proved_wrong_holds_its_nodes_other_shards_out_at_once(engine):
    build = builder(engine, failing_opens=0)
    caught = f"{MODEL_ID}:0-3+int8@only"  # proved wrong a moment ago; the read model does not know it yet
    build.ctx.quarantined.add(caught)
    with pytest.raises(RoutingError) as error:
        await build.build()
    assert f"{MODEL_ID}:0-7@only: excluded from this call: node only quarantined (shard {caught} mismatched)" \
        in error.value.message
    assert build.opens == []


async def test_a_broker_failure_under_the_open_waits_for_the_connection_and_goes_on(engine):
    build = builder(engine, failing_opens=1, kind="broker")
    chain = await build.build()
    assert build.opens == [chain.hops[0].shard_id] * 2
    assert build.call.excluded == {}  # no shard is to blame


async def test_a_call_no_shard_would_open_is_told_what_the_shards_answered(engine):
    build = builder(engine, failing_opens=10, kind="unauthorized")
    with pytest.raises(RoutingError) as error:
        await build.build()
    assert error.value.code == "shard_unavailable"
    assert STALE_OPEN in error.value.message and "\n" not in error.value.message


class FailingFlushNats:
    """A NATS client whose connection fails under the first flush: subscriptions are written, never confirmed."""

    max_payload = 1024 * 1024
    is_connected = is_closed = False
    pending_data_size = 0
    connected_url = None
    servers = ()

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.requests: list[str] = []

    async def subscribe(self, subject: str, **kwargs) -> SimpleNamespace:
        async def unsubscribe() -> None:
            pass
        return SimpleNamespace(unsubscribe=unsubscribe)

    async def flush(self, timeout: float) -> None:
        self.stats["reconnects"] += 1
        raise FlushTimeoutError

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict | None = None):
        self.requests.append(subject)
        raise AssertionError("no hop is asked to open over subscriptions the broker did not confirm")


async def test_a_chain_whose_subscriptions_the_broker_did_not_confirm_is_a_broker_failure():
    nc = FailingFlushNats()
    hops = [Hop("s0", "hearth.ctl.n0.s0", "n0", 0, 7)]
    chain = HopChain(nc, "p-flush", hops, node_id="orch", model_id="m", weights_sha256="w",
                     transport=TransportSettings())
    failure = await chain.open()
    assert failure is not None and failure.kind == "broker" and failure.shard_id is None
    assert nc.requests == []


async def test_our_quarantine_hands_over_to_the_read_model_so_a_stewards_clearing_lifts_it(engine):
    build = builder(engine, failing_opens=0)
    caught = f"{MODEL_ID}:0-3+int8@only"
    build.ctx.quarantined.add(caught)
    with engine.begin() as connection:  # the read model has projected our mismatch event
        connection.execute(text(
            "INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, disputes, "
            "status, updated_at) VALUES (:shard, 'only', 0, 0, 1, 0, 'quarantined', 5)"), {"shard": caught})
    with pytest.raises(RoutingError):
        await build.build()
    assert build.ctx.quarantined == set()  # the read model holds it now
    with engine.begin() as connection:  # a steward cleared it
        connection.execute(text("UPDATE shard_reputation SET status = 'ok'"))
    build.call.excluded = {}
    chain = await build.build()
    assert [hop.shard_id for hop in chain.hops] == [f"{MODEL_ID}:0-7@only"]


async def test_every_shard_of_a_node_our_checks_proved_wrong_hands_over_though_none_is_advertised(engine):
    # Two shards of one node caught at once, both gone since: the read model's quarantine of each is handed over,
    # so clearing both frees the node here too (not only the one that names the node's hold).
    build = builder(engine, failing_opens=0)
    caught = {f"{MODEL_ID}:0-3+int8@only", f"{MODEL_ID}:4-7+int8@only"}
    build.ctx.quarantined |= caught
    with engine.begin() as connection:  # the read model has projected both mismatch events
        for shard in caught:
            connection.execute(text(
                "INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, disputes, "
                "status, updated_at) VALUES (:shard, 'only', 0, 0, 1, 0, 'quarantined', 5)"), {"shard": shard})
    with pytest.raises(RoutingError):
        await build.build()
    assert build.ctx.quarantined == set()
    with engine.begin() as connection:  # a steward cleared both
        connection.execute(text("UPDATE shard_reputation SET status = 'ok'"))
    build.call.excluded = {}
    chain = await build.build()
    assert [hop.shard_id for hop in chain.hops] == [f"{MODEL_ID}:0-7@only"]


# A chain's record whose taps saw no step passed on told otherwise (all the verifier reads of it here).
NO_RETELLING = SimpleNamespace(take_retold=lambda: None)


async def test_a_call_running_on_a_shard_proved_wrong_meanwhile_withdraws_its_work_there_once_it_is_handed_over(
        engine):
    # Another call's check proves the hop wrong, the read model quarantines it and a construction hands it over,
    # all between two turns of this call (a long prefill): this call still withdraws the hop's unconfirmed work.
    running = builder(engine, failing_opens=0)
    chain = await running.build()
    verifier = CallVerifier(running.call, running.ctx, record=None)
    await verifier.attach(SimpleNamespace(hops=chain.hops, recorder=NO_RETELLING))
    [hop] = chain.hops
    running.ctx.prove_wrong(hop.shard_id)
    with engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, disputes, "
            "status, updated_at) VALUES (:shard, 'only', 0, 0, 1, 0, 'quarantined', 5)"), {"shard": hop.shard_id})
    another = builder(engine, failing_opens=0)
    another.ctx = running.ctx
    with pytest.raises(RoutingError):
        await another.build()
    assert running.ctx.quarantined == set()  # handed over
    refuted = verifier.refuted()
    assert refuted is not None and refuted.shard_id == hop.shard_id and "quarantined meanwhile" in refuted.reason
    # A call that begins after the proof was never routed there: nothing of it to refute.
    later = CallVerifier(running.call, running.ctx, record=None)
    await later.attach(SimpleNamespace(hops=chain.hops, recorder=NO_RETELLING))
    assert later.refuted() is None
