"""Failover from shards that stay connected but misbehave: frozen (SIGSTOP), slow (`--fault delay_s`), returning
NaN or activations x 1e4; routing health: re-advertisement, withdrawal, a stopped shard's drain; and, last, a broker
restart mid-run.
One mesh serves the module: honest shards h0-h2 (hop_weight 1, with /metrics) over layers 0-1, 2-3, 4-5, an
orchestrator with a 1 s step timeout, and a `hearth projector` process. Each fault test starts its own
preferred shard x (hop_weight 0.5, so it is the one routed to), breaks it mid-generation, and stops it at the
end (a stopped shard withdraws)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hearth.events.consume import stream_last_seq
from hearth.events.models import ShardAdvertised, ShardWithdrawn
from hearth.services.broker.connection import connect_nats
from hearth.services.broker.listen_ports import free_tcp_port
from tests.e2e.conftest import THREE_SHARD_RANGES
from tests.e2e.event_log_checks import assert_no_event_lost, query, resume_timeout_s, wait_for_positions
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    nc,
    run_reference_call,
    ACT_AFTER_TOKENS,
    MAX_TOKENS,
    PIPELINES_STREAM,
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    SHARD_TTL_S,
    SHARDS_STREAM,
    STEP_TIMEOUT_S,
    chat_request,
    failover_mesh,
    pipeline_events,
    read_events,
    scrape_metric,
    stream_with_action,
    wait_for_event,
    wait_until_released,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "failover-faults") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, metrics_port=free_tcp_port(),
                             wait_ready=False)
        mesh.start_orchestrator(local_model=False)
        mesh.projector_db = mesh.cluster.work_dir / "projector.sqlite"
        mesh.cluster.start_projector(mesh.projector_db)
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def reference(mesh):
    call = run_reference_call(mesh.cluster)
    assert call.final.type == "done" and len(call.token_ids) == MAX_TOKENS, call.final
    return call


@pytest.fixture
async def preferred(mesh):
    """start(node_id, hop, fault=None): a shard for hop `hop`'s layers that the router prefers; stopped after."""
    started = []

    async def start(node_id: str, hop: int, fault: str | None = None):
        lo, hi = THREE_SHARD_RANGES[hop]
        handle = await asyncio.to_thread(mesh.start_shard, node_id, lo, hi, hop_weight=PREFERRED_WEIGHT,
                                         fault=fault)
        started.append(handle)
        await mesh.wait_advertised(handle)
        return handle

    yield start
    for handle in started:
        await asyncio.to_thread(mesh.stop_shard, handle)  # SIGCONT first, then SIGTERM: it withdraws


def assert_failed_over_once(call, reference, culprit, replacement) -> None:
    assert culprit.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    failovers = call.of_type("shard_failover")
    assert len(failovers) == 1, failovers
    assert failovers[0].failed_shard_id == culprit.shard_id
    assert replacement.shard_id in failovers[0].replacement_hops
    assert [(f.shard_id, f.status) for f in call.of_type("shard_status")] == [(culprit.shard_id, "degraded")]
    assert call.token_ids == reference.token_ids


async def test_frozen_shard_is_detected_and_failed_over(mesh, reference, nc, preferred):
    frozen = await preferred("x-frozen", 1)
    try:
        call = await stream_with_action(nc, chat_request(), lambda: frozen.process.signal(signal.SIGSTOP))
        assert_failed_over_once(call, reference, frozen, mesh.shards["h1"])
        # Still connected, so not taken for dead: blamed for answering no probe (as a cut link is).
        assert "no longer connected" not in call.of_type("shard_status")[0].reason
        failover = call.of_type("shard_failover")[0]
        assert failover.resumed_at_token >= ACT_AFTER_TOKENS
    finally:
        frozen.process.signal(signal.SIGCONT)
    # Thawed, it reads the close the orchestrator sent while it was frozen and frees that session.
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats


async def test_slow_shard_is_marked_degraded_and_failed_over(mesh, reference, nc, preferred):
    slow = await preferred("x-slow", 0, fault=f"after_steps={ACT_AFTER_TOKENS},delay_s=3")
    call = await stream_with_action(nc, chat_request())
    assert_failed_over_once(call, reference, slow, mesh.shards["h0"])
    assert "not passed on" in call.of_type("shard_status")[0].reason
    types = [e.event.type for e in await pipeline_events(nc, call.pipeline_id)]
    assert "pipeline.shard_status" in types and "integrity.corruption_detected" not in types


async def test_a_step_that_raises_is_reported_at_once_and_only_that_shard_is_blamed(mesh, reference, nc, preferred):
    failing = await preferred("x-fail", 1, fault=f"after_steps={ACT_AFTER_TOKENS},fail")
    call = await stream_with_action(nc, chat_request())
    assert_failed_over_once(call, reference, failing, mesh.shards["h1"])
    reason = call.of_type("shard_status")[0].reason
    assert "injected step failure" in reason, reason
    # Told by the shard itself (a HopNotice), not found by the stall watch after the 1 s step timeout.
    failover = [e.event for e in await pipeline_events(nc, call.pipeline_id) if e.event.type == "pipeline.failover"]
    assert [(f.failed_shard_id, f.reason) for f in failover] == [(failing.shard_id, "step_failed")]
    assert call.longest_token_gap_s() < STEP_TIMEOUT_S


@pytest.mark.parametrize(
    ("hop", "fault", "check", "checked_by"),
    [
        (1, "after_steps=3,nan", "nan", "h2"),  # the next shard catches it on its input
        (0, "after_steps=3,scale=10000", "norm", "h1"),
        (2, "after_steps=3,scale=10000", "norm", None),  # the last hop's output: the orchestrator catches it
    ],
    ids=["nan-middle-hop", "scaled-first-hop", "scaled-last-hop"],
)
async def test_corrupting_shard_is_caught_and_routed_around_and_blamed_only_when_verified(
        mesh, reference, nc, preferred, hop, fault, check, checked_by):
    liar = await preferred(f"x-liar{hop}", hop, fault=fault)
    checker = mesh.shards[checked_by] if checked_by else None
    labels = {"check": check, "checked_at": "hop_input"}
    before = scrape_metric(checker.metrics_port, "hearth_integrity_failures_total", labels) if checker else 0.0
    orchestrator_port = mesh.orchestrator.metrics_port
    # A shard's report of its input is routed around but cannot be verified; the orchestrator's own check can.
    reason = "reported" if checker else "corrupt"
    failovers_before = scrape_metric(orchestrator_port, "hearth_failovers_total", {"reason": reason})

    call = await stream_with_action(nc, chat_request())

    assert_failed_over_once(call, reference, liar, mesh.shards[f"h{hop}"])
    events = await pipeline_events(nc, call.pipeline_id)
    detected = [e.event for e in events if e.event.type == "integrity.corruption_detected"]
    assert scrape_metric(orchestrator_port, "hearth_failovers_total", {"reason": reason}) == failovers_before + 1
    if checker is not None:
        assert scrape_metric(checker.metrics_port, "hearth_integrity_failures_total", labels) == before + 1
        # The checker's word against the liar: no event blames it, routing does not hold it against it.
        assert detected == []
        assert "pipeline.shard_status" not in [e.event.type for e in events]
        assert [(e.event.failed_shard_id, e.event.reason) for e in events
                if e.event.type == "pipeline.failover"] == [(liar.shard_id, "reported")]
        assert scrape_metric(orchestrator_port, "hearth_shard_corruption_detected_total",
                             {"shard_id": liar.shard_id, "check": check}) == 0
        return
    # The orchestrator counts the corruption it saw itself, blaming the liar.
    assert [(d.shard_id, d.check) for d in detected] == [(liar.shard_id, check)]
    assert scrape_metric(orchestrator_port, "hearth_shard_corruption_detected_total",
                         {"shard_id": liar.shard_id, "check": check}) == 1
    # The orchestrator's read model keeps it as a reputation signal.
    await mesh.wait_routing("shard_stats", liar.shard_id, lambda row: row["corruption_detections"] == 1)


async def test_withdrawn_shard_is_not_routed_to_until_it_advertises_again(mesh, reference, nc, preferred):
    node = await preferred("x-withdraws", 2)
    first = await stream_with_action(nc, chat_request(max_tokens=2))
    assert node.shard_id in first.first_hops

    await asyncio.to_thread(node.process.stop)  # SIGTERM: a clean stop publishes shard.withdrawn
    await mesh.wait_routing("shards", node.shard_id, lambda row: row["status"] == "withdrawn")
    while_gone = await stream_with_action(nc, chat_request(max_tokens=2))
    assert while_gone.final.type == "done"
    assert node.shard_id not in while_gone.first_hops and mesh.shards["h2"].shard_id in while_gone.first_hops

    back = await preferred("x-withdraws", 2)  # same node, same shard_id: it advertises again
    again = await stream_with_action(nc, chat_request(max_tokens=2))
    assert back.shard_id == node.shard_id and back.shard_id in again.first_hops


async def test_a_shard_stopped_mid_call_lets_the_call_end_and_takes_no_new_one(mesh, reference, nc, preferred):
    """SIGTERM reaches a shard a call goes through: it withdraws at once and serves the call to its end (same greedy
    tokens, no failover, nobody blamed), then exits; the next call is routed around it. Before, it stopped at once
    and the call failed over."""
    leaving = await preferred("x-leaves", 1)
    call = await stream_with_action(nc, chat_request(), lambda: leaving.process.signal(signal.SIGTERM))
    assert leaving.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    assert call.token_ids == reference.token_ids
    assert call.of_type("shard_failover") == [] and call.of_type("shard_status") == []
    events = await pipeline_events(nc, call.pipeline_id)
    assert not [e.event.type for e in events if e.event.type in ("pipeline.failover", "pipeline.shard_status")]
    assert await asyncio.to_thread(leaving.process.popen.wait, 30) == 0
    withdrawals = [e.event.reason for e in await read_events(nc, SHARDS_STREAM)
                   if isinstance(e.event, ShardWithdrawn) and e.event.shard_id == leaving.shard_id]
    assert withdrawals == ["shutdown"]
    await mesh.wait_routing("shards", leaving.shard_id, lambda row: row["status"] == "withdrawn")
    after = await stream_with_action(nc, chat_request(max_tokens=2))
    assert after.final.type == "done" and leaving.shard_id not in after.first_hops


async def test_shards_re_advertise_within_their_ttl(mesh, nc):
    shard_id = mesh.shards["h0"].shard_id

    def advertisement_of_h0(item) -> bool:
        return isinstance(item.event, ShardAdvertised) and item.event.shard_id == shard_id

    first = await wait_for_event(nc, SHARDS_STREAM, advertisement_of_h0)
    later = await wait_for_event(nc, SHARDS_STREAM, lambda item: advertisement_of_h0(item) and item.seq > first.seq,
                                 timeout_s=SHARD_TTL_S * 2)
    gap_s = (later.event.occurred_at - first.event.occurred_at).total_seconds()
    # Every ttl/3: the advertisement never expires while the shard lives.
    assert 0 < gap_s < SHARD_TTL_S
    withdrawals = [e for e in await read_events(nc, SHARDS_STREAM)
                   if isinstance(e.event, ShardWithdrawn) and e.event.shard_id == shard_id]
    assert withdrawals == []


async def test_nats_restart_mid_run(mesh, reference):
    """Last in the module: restarting nats-server disturbs everything connected to it."""
    nc = await connect_nats(mesh.cluster.nats_url, name="failover-test", settings=mesh.cluster.nats_settings())
    try:
        js = nc.jetstream()

        before: dict[str, int] = {}

        async def restart_broker() -> None:
            for stream in (SHARDS_STREAM, PIPELINES_STREAM):
                before[stream] = await stream_last_seq(js, stream)
            await asyncio.to_thread(mesh.cluster.nats.restart)

        # A request streaming while the broker goes away completes as if nothing happened, or ends with
        # pipeline_stalled naming the broker; either way no (healthy) shard is blamed.
        in_flight = await stream_with_action(nc, chat_request(), restart_broker)
        assert in_flight.final.type in ("done", "pipeline_aborted", "error"), in_flight.final
        if in_flight.final.type == "done":
            assert in_flight.token_ids == reference.token_ids
        else:
            assert in_flight.final.code == "pipeline_stalled", in_flight.final
            assert "broker" in (getattr(in_flight.final, "reason", None) or in_flight.final.message)
        assert in_flight.of_type("shard_status") == [] and in_flight.of_type("shard_failover") == []

        # Every shard host advertises again once reconnected.
        readvertised = {}
        for handle in mesh.live_shards():
            def advertised_again(item, shard_id=handle.shard_id) -> bool:
                return (isinstance(item.event, ShardAdvertised) and item.event.shard_id == shard_id
                        and item.seq > before[SHARDS_STREAM])

            event = await wait_for_event(nc, SHARDS_STREAM, advertised_again, timeout_s=resume_timeout_s)
            readvertised[handle.shard_id] = event.seq

        # The orchestrator's projector resumed (it routes on what came after the restart), and so did the
        # standalone one.
        await wait_for_positions(mesh.orchestrator_db, {SHARDS_STREAM: max(readvertised.values())})
        after = await stream_with_action(nc, chat_request())
        assert after.final.type == "done", after.final
        assert after.token_ids == reference.token_ids

        targets = {stream: await stream_last_seq(js, stream) for stream in (SHARDS_STREAM, PIPELINES_STREAM)}
        await wait_for_positions(mesh.projector_db, targets)

        # Nothing stored before the restart is missing: every pipeline in the log is a row, and one that ended
        # before the restart has the status its last event gives it.
        logged = [item for item in await read_events(nc, PIPELINES_STREAM) if item.seq <= before[PIPELINES_STREAM]]
        assert len({item.event.pipeline_id for item in logged}) >= 2, "too few pipelines before the restart"
        ended = {item.event.pipeline_id: item.event.type.split(".")[1] for item in logged
                 if item.event.type in ("pipeline.completed", "pipeline.aborted")}
        for db in (mesh.projector_db, mesh.orchestrator_db):
            rows = {row["pipeline_id"]: row["status"] for row in query(db, "SELECT * FROM pipelines")}
            for item in logged:
                assert item.event.pipeline_id in rows, (db.name, item.event.type, item.seq)
            assert {pipeline_id: rows[pipeline_id] for pipeline_id in ended} == ended, db.name
            assert rows[reference.pipeline_id] == "completed"
            shard_rows = {row["shard_id"]: row["status"] for row in query(db, "SELECT * FROM shards")}
            assert all(shard_rows.get(h.shard_id) == "advertised" for h in mesh.live_shards()), shard_rows

        # No acknowledged event is lost: both streams hold contiguous sequences, and the standalone projector's
        # read model equals one rebuilt from the log (the shards stopped first, so the log stands still).
        for handle in mesh.live_shards():
            await asyncio.to_thread(mesh.stop_shard, handle)
        await assert_no_event_lost(nc, mesh.projector_db, mesh.cluster.work_dir / "rebuilt.sqlite")
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
