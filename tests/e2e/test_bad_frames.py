"""Bad activation frames on a running pipeline of real processes: frames injected on a shard's and on the
orchestrator's activation subjects (claiming half a gigabyte, 70 000 chunks, another hidden size or dtype, no
tokens) are refused and counted without allocation, the shard's memory stays flat and the answer is unchanged;
a faulty shard whose output is empty or mis-shaped fails its step at once with a typed failure (the next hop or
the orchestrator refuses it and says so), long before the step timeout, and the call fails over.

One mesh serves the module: honest shards h0-h2 over tiny-llama's layers 0-1, 2-3, 4-5 (with /metrics) and an
orchestrator whose step timeout is STEP_TIMEOUT_S, far longer than any failover here may take."""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth.protocol.subjects import LinkNodes, activation_subject
from hearth.services.client.chat import stream_chat
from hearth.protocol.chat_frames import PipelineFrame, TokenDeltaFrame
from hearth.services.broker.connection import flush_ordered
from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.transport import FrameHeader, FrameKind
from hearth.services.transport.wire import WireDtype, wire_nbytes
from tests.e2e.conftest import THREE_SHARD_RANGES, start_orchestrator
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    PREFERRED_WEIGHT,
    PRIMARY_WEIGHT,
    StreamedCall,
    chat_request,
    failover_mesh,
    nc,
    scrape_metric,
    stream_with_action,
    wait_until_released,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HIDDEN = 64  # tiny-llama's hidden size
STEP_TIMEOUT_S = 30.0
# A refused step is reported at once: the failover it causes takes a fraction of the step timeout.
FAILOVER_WITHIN_S = 5.0
MAX_TOKENS = 60
INJECT_AFTER_TOKENS = 2
INJECTION_ROUNDS = 40
RSS_ALLOWANCE_BYTES = 50 * 1024 * 1024
REFUSED_METRIC = "hearth_activation_frames_refused_total"

# (reason the receiver gives, what the forged frame claims)
FORGERIES = [
    ("positions", dict(shape=(1, 2_000_000, HIDDEN), chunks=500)),  # 512 MB
    ("chunks", dict(shape=(1, 8, HIDDEN), chunks=2000)),
    ("shape", dict(shape=(1, 4, HIDDEN + 3))),
    ("shape", dict(shape=(1, 0, HIDDEN))),
    ("dtype", dict(shape=(1, 4, HIDDEN), dtype=WireDtype.int8, block=64, compute=WireDtype.float32)),
]


def forged_headers(pipeline_id: str, hop: int, step: int, *, shape, dtype=WireDtype.float32, chunks: int = 1,
                   block: int | None = None, compute: WireDtype | None = None) -> dict[str, str]:
    total = wire_nbytes(dtype, shape, block)
    return FrameHeader(pipeline_id=pipeline_id, hop=hop, session="forged-session", step=step,
                       kind=FrameKind.prefill, pos=0, chunk_index=0, chunk_count=chunks, dtype=dtype,
                       compute_dtype=compute or dtype, shape=shape, offset=0, total_bytes=total,
                       int8_block=block).to_nats_headers()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    with failover_mesh(tmp_path_factory, tiny_models_dir, "bad-frames") as mesh:
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES):
            mesh.start_shard(f"h{index}", lo, hi, hop_weight=PRIMARY_WEIGHT, metrics_port=free_tcp_port(),
                             wait_ready=False)
        mesh.orchestrator_db = mesh.cluster.work_dir / "orchestrator-routing.sqlite"
        mesh.orchestrator = start_orchestrator(mesh.cluster, tiny_models_dir, extra_args=[
            "--step-timeout-s", str(STEP_TIMEOUT_S), "--db", str(mesh.orchestrator_db)])
        mesh.cluster.wait_all_ready()
        mesh.wait_all_advertised()
        yield mesh


@pytest.fixture(scope="module")
def reference(mesh):
    """One uninterrupted greedy call: what every call below must still answer."""

    async def run():
        from hearth.services.broker.connection import connect_nats

        client = await connect_nats(mesh.cluster.nats_url, name="reference", settings=mesh.cluster.nats_settings())
        try:
            return await stream_with_action(client, chat_request(max_tokens=MAX_TOKENS))
        finally:
            await client.close()

    call = asyncio.run(run())
    assert call.final.type == "done" and len(call.token_ids) == MAX_TOKENS, call.final
    return call


async def test_injected_frames_are_refused_without_allocation_and_the_answer_is_unchanged(mesh, reference, nc):
    h1 = mesh.shards["h1"]
    # The injector has no link key, so every forgery is dropped for its MAC before its declared sizes are even
    # read (tests/integration/test_transport_refusals.py checks those limits on a receiver without a key).
    refused_before = scrape_metric(h1.metrics_port, REFUSED_METRIC, {"reason": "mac"})
    measured: dict[str, int] = {}

    async def inject(pipeline: PipelineFrame) -> None:
        measured["shard_before"] = rss_bytes(h1.process.popen.pid)
        measured["orchestrator_before"] = rss_bytes(mesh.orchestrator.popen.pid)
        hops = pipeline.hops
        # Into hop 1 (h1's inbound subject) and into the orchestrator's sink (hop 3).
        targets = [(activation_subject(pipeline.pipeline_id, 1, LinkNodes(receiver=hops[1].rsplit("@", 1)[1])), 1),
                   (activation_subject(pipeline.pipeline_id, len(hops), LinkNodes(receiver="orchestrator")),
                    len(hops))]
        for round_ in range(INJECTION_ROUNDS):
            for index, (_, claim) in enumerate(FORGERIES):
                for subject, hop in targets:
                    headers = forged_headers(pipeline.pipeline_id, hop, 1000 + 10 * round_ + index, **claim)
                    await nc.publish(subject, b"\x00" * 256, headers=headers)
        await flush_ordered(nc)

    frames = []
    async for frame in stream_chat(nc, chat_request(max_tokens=MAX_TOKENS), first_frame_timeout=60,
                                   frame_gap_timeout=30):
        frames.append(frame)
        if sum(isinstance(f, TokenDeltaFrame) for f in frames) == INJECT_AFTER_TOKENS and not measured:
            await inject(frames[0])
    call = StreamedCall(frames=frames)
    shard_after = rss_bytes(h1.process.popen.pid)
    orchestrator_after = rss_bytes(mesh.orchestrator.popen.pid)
    print(f"injected {INJECTION_ROUNDS * len(FORGERIES)} frames per receiver; shard h1 RSS "
          f"{measured['shard_before'] / 2**20:.0f} -> {shard_after / 2**20:.0f} MiB, orchestrator RSS "
          f"{measured['orchestrator_before'] / 2**20:.0f} -> {orchestrator_after / 2**20:.0f} MiB")

    assert call.final.type == "done", call.final
    assert call.token_ids == reference.token_ids
    assert not call.of_type("shard_failover") and not call.of_type("shard_status")
    assert shard_after - measured["shard_before"] < RSS_ALLOWANCE_BYTES
    assert orchestrator_after - measured["orchestrator_before"] < RSS_ALLOWANCE_BYTES
    counted = scrape_metric(h1.metrics_port, REFUSED_METRIC, {"reason": "mac"}) - refused_before
    assert counted == INJECTION_ROUNDS * len(FORGERIES)


@pytest.mark.parametrize("fault, hop", [("empty", 1), ("misshape", 1), ("empty", 2), ("misshape", 2)])
async def test_an_empty_or_mis_shaped_output_fails_the_step_at_once(mesh, reference, nc, fault, hop):
    lo, hi = THREE_SHARD_RANGES[hop]
    # Preferred by the router (lower hop weight), healthy for 3 steps, then its output is bad.
    faulty = await asyncio.to_thread(mesh.start_shard, f"x-{fault}-{hop}", lo, hi, hop_weight=PREFERRED_WEIGHT,
                                     fault=f"after_steps=3,{fault}")
    try:
        await mesh.wait_advertised(faulty)
        await mesh.wait_idle_in_routing(mesh.shards[f"h{hop}"])
        started = time.monotonic()
        call = await stream_with_action(nc, chat_request(max_tokens=MAX_TOKENS))
        elapsed_s = time.monotonic() - started
    finally:
        await asyncio.to_thread(mesh.stop_shard, faulty)
    print(f"{fault} output from hop {hop}: failover pause {call.longest_token_gap_s() * 1000:.0f} ms, "
          f"call {elapsed_s:.1f} s; {call.of_type('shard_status')[0].reason if call.of_type('shard_status') else ''}")

    assert faulty.shard_id in call.first_hops
    assert call.final.type == "done", call.final
    assert call.token_ids == reference.token_ids
    failovers = call.of_type("shard_failover")
    assert [f.failed_shard_id for f in failovers] == [faulty.shard_id]
    reason = call.of_type("shard_status")[0].reason
    assert "refused" in reason and ("carries no tokens" in reason or f"1,<tokens>,{HIDDEN}" in reason), reason
    # Told at once, not found by the stall watch after STEP_TIMEOUT_S.
    assert call.longest_token_gap_s() < FAILOVER_WITHIN_S < STEP_TIMEOUT_S
    stats = await wait_until_released(nc, mesh.live_shards())
    assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats
