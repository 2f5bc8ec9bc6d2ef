"""Hearth across households (hearth/services/devtools/netbed.py): the broker and the orchestrator in a hub namespace,
each shard host in a household of its own, all joined by links that can be cut while the processes behind them run on.

A secure mesh over the hub's real address (credentials, TLS with a certificate for 198.18.0.1): primaries p0-p2
over the tiny model's three ranges in households 0-2, a replica r1 of the middle range in household 3, and an
orchestrator with the default step timeout. Each household reaches the broker through its link's latency relay
(hearth/services/devtools/netbed_relay.py, 0 ms unless a test sets it). Calls at 10 ms RTT per household link and
through a 20 Mbit/s link with a long prompt give the unshaped run's tokens. The middle primary's link is cut
mid-generation: the call fails over to r1 with the uninterrupted run's tokens, decided by the probe that finds p1
unreachable rather than by the step timeout; healed, p1 serves again without a restart. Last, with a fresh replica, p1's
link flaps mid-generation: the tokens are unchanged and p1 serves afterwards. The pauses a client sees are printed
(BENCHMARKS.md, "Cut link" and "Households over real links"). Needs root and network namespaces; skips, saying why,
elsewhere."""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.devtools.netbed import NetBed, unavailable_reason
from tests.e2e.conftest import THREE_SHARD_RANGES, TINY_MODEL_NAME
from tests.e2e.failover_support import (  # noqa: F401 (nc is a fixture)
    HEARTBEAT_S,
    MAX_TOKENS,
    PRIMARY_WEIGHT,
    REPLICA_WEIGHT,
    SHARD_TTL_S,
    FailoverMesh,
    ShardHandle,
    chat_request,
    failover_env,
    nc,
    run_reference_call,
    shard_stat,
    stream_with_action,
    wait_until_released,
)

NO_BED = unavailable_reason()
pytestmark = [pytest.mark.scheduled_first, pytest.mark.timeout(600),
              pytest.mark.skipif(NO_BED is not None, reason=f"no multi-household test bed here: {NO_BED}")]

# Household of each shard host: the middle range's primary and its replica live apart.
PLACEMENT = {"p0": 0, "p1": 1, "p2": 2, "r1": 3}
CUT_HOUSEHOLD = PLACEMENT["p1"]
heal_wait_s = 30.0
LINK_RTT_MS = 10.0
SHAPED_RATE_MBIT = 20.0
# About 900 prompt tokens (the tiny tokenizer is byte-level): a prefill whose activations queue behind the shaper.
LONG_PROMPT = " ".join(f"household {index} keeps its own fire burning through the night;" for index in range(16))
LONG_PROMPT_MAX_TOKENS = 8
# The flapping link: down, then up (heal() returns once it forwards), this many times.
FLAPS = 4
flap_down_s = 0.4
flap_up_s = 0.4


@pytest.fixture(scope="module")
def bed():
    with NetBed(households=len(PLACEMENT)) as made:
        # This thread (the tests' event loop's) dials the broker at the hub's address, so it lives in the hub.
        with made.entered(made.hub):
            yield made


def start_household_shard(bed: NetBed, mesh: FailoverMesh, node_id: str, household: int) -> ShardHandle:
    """Shard host `node_id` (p: a primary, r: a replica; its digit names the range) in `household`, reaching the
    broker through the household's relay; not waited for."""
    lo, hi = THREE_SHARD_RANGES[int(node_id[1])]
    weight = PRIMARY_WEIGHT if node_id.startswith("p") else REPLICA_WEIGHT
    process = mesh.cluster.start_shard(
        str(mesh.model_path), lo, hi, node_id=node_id, wait_ready=False,
        command_prefix=bed.households[household].exec_prefix(), nats_url=bed.relay_url(household),
        extra_args=["--hop-weight", str(weight), "--heartbeat-s", str(HEARTBEAT_S), "--ttl-s", str(SHARD_TTL_S)])
    mesh.shards[node_id] = ShardHandle(process, node_id, lo, hi)
    return mesh.shards[node_id]


@pytest.fixture(scope="module")
def mesh(bed, tmp_path_factory, tiny_models_dir):
    work_dir = tmp_path_factory.mktemp("households")
    # Fresh processes behind `ip netns exec` (the prefork launcher's forks could not change namespace); no
    # /metrics (a household's 127.0.0.1 is not the tests').
    with LocalCluster(work_dir=work_dir / "cluster", torch_threads=1, extra_env=failover_env(), tls=True,
                      tls_host_names=(bed.hub.address,), prefork=False, metrics=False) as cluster:
        cluster.start_nats(host=bed.hub.address)
        bed.start_relay(cluster.nats.port)
        mesh = FailoverMesh(cluster, tiny_models_dir)
        try:
            for node_id, household in PLACEMENT.items():
                start_household_shard(bed, mesh, node_id, household)
            mesh.orchestrator_db = cluster.work_dir / "orchestrator-routing.sqlite"
            mesh.orchestrator = cluster.start_orchestrator(
                wait_ready=False, command_prefix=bed.hub.exec_prefix(),
                extra_args=["--models-dir", str(tiny_models_dir), "--preload", TINY_MODEL_NAME,
                            "--db", str(mesh.orchestrator_db)])
            cluster.wait_all_ready()
            mesh.wait_all_advertised()
            yield mesh
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(6000)}")


@pytest.fixture(scope="module")
def relay(bed, mesh):
    """The latency relay every household reaches the broker through (started with the mesh)."""
    return bed.relays[0]


@pytest.fixture(scope="module")
def reference(mesh):
    call = run_reference_call(mesh.cluster)
    assert call.final.type == "done" and len(call.token_ids) == MAX_TOKENS, call.final
    assert call.first_hops == [mesh.shards[f"p{i}"].shard_id for i in range(3)]
    return call


async def wait_serving_again(nc, mesh, host: ShardHandle, healed_at: float) -> None:
    """The healed host answers, holds nothing of a call it lost, and the orchestrator sees it idle."""
    deadline = healed_at + heal_wait_s
    while True:
        try:
            await shard_stat(nc, host)
            break
        except Exception:
            assert time.monotonic() < deadline, f"{host.node_id} never answered again"
            await asyncio.sleep(0.2)
    stats = await wait_until_released(nc, [host], timeout_s=heal_wait_s)
    assert stats[host.node_id].active_streams == 0 and stats[host.node_id].cached_sessions == 0, stats
    await mesh.wait_idle_in_routing(host)


async def test_a_call_over_household_links_with_10_ms_rtt_gives_the_0_ms_tokens(bed, relay, reference, nc):
    links = [bed.relay_port(index) for index in range(len(bed.households))]
    started = time.monotonic()
    try:
        for port in links:
            relay.set_rtt(port, LINK_RTT_MS)
        call = await stream_with_action(nc, chat_request())
    finally:
        for port in links:
            relay.set_rtt(port, 0.0)
    print(f"{LINK_RTT_MS:g} ms RTT per household link: {MAX_TOKENS} tokens in {time.monotonic() - started:.2f} s")
    assert call.final.type == "done", call.final
    assert call.of_type("shard_status") == [] and call.of_type("shard_failover") == []
    assert call.token_ids == reference.token_ids


async def test_a_household_behind_a_20_mbit_link_serves_a_long_prompt(bed, mesh, nc):
    shaped = mesh.shards["p1"]
    long_request = chat_request(max_tokens=LONG_PROMPT_MAX_TOKENS).model_copy(update={"prompt": LONG_PROMPT})
    # Shaped first: a later call with the same prompt may find its prefix cached on the hosts and send less.
    await mesh.wait_idle_in_routing(shaped)
    bed.shape(CUT_HOUSEHOLD, SHAPED_RATE_MBIT)
    try:
        before = bed.shaped_counters(CUT_HOUSEHOLD)
        call = await stream_with_action(nc, long_request)
        after = bed.shaped_counters(CUT_HOUSEHOLD)
    finally:
        bed.unshape(CUT_HOUSEHOLD)
    print(f"{SHAPED_RATE_MBIT:g} Mbit/s link: {after['sent'] - before['sent']} bytes sent, "
          f"{after['overlimits'] - before['overlimits']} packets held back by the shaper")
    assert call.final.type == "done", call.final
    # Nothing timed out: no host was reported or failed over, and the call ran through the shaped household.
    assert call.of_type("shard_status") == [] and call.of_type("shard_failover") == []
    assert shaped.shard_id in call.first_hops
    assert after["overlimits"] > before["overlimits"]  # the link did hold the prefill back

    await mesh.wait_idle_in_routing(shaped)
    unshaped = await stream_with_action(nc, long_request)
    assert unshaped.final.type == "done", unshaped.final
    assert call.token_ids == unshaped.token_ids


async def test_a_cut_household_link_fails_over_and_the_healed_host_serves_again(bed, mesh, reference, nc):
    cut_host, replica = mesh.shards["p1"], mesh.shards["r1"]
    await mesh.wait_idle_in_routing(cut_host)
    try:
        call = await stream_with_action(nc, chat_request(), lambda: bed.cut(CUT_HOUSEHOLD))
    finally:
        healed_at = time.monotonic()
        bed.heal(CUT_HOUSEHOLD)
    print(f"cut link: longest pause between tokens {call.longest_token_gap_s():.2f} s")

    assert cut_host.process.alive  # cut off, not killed
    assert call.final.type == "done", call.final
    failovers = call.of_type("shard_failover")
    assert [f.failed_shard_id for f in failovers] == [cut_host.shard_id]
    assert replica.shard_id in failovers[0].replacement_hops
    assert call.token_ids == reference.token_ids
    degraded = call.of_type("shard_status")
    assert [(f.shard_id, f.status) for f in degraded] == [(cut_host.shard_id, "degraded")]
    # Found by the probe it did not answer, not by waiting out the step timeout.
    assert "does not answer" in degraded[0].reason and "not taken in within" not in degraded[0].reason, \
        degraded[0].reason

    # Healed: the same process answers again, frees the session of the call it lost, and reports itself idle.
    await answers_alone_once_healed(nc, mesh, cut_host, replica, reference, healed_at)


async def answers_alone_once_healed(nc, mesh, host, replica, reference, healed_at: float) -> None:
    """`host`, its link healed at `healed_at`, serves again: with `replica` stopped, a new call runs through it and
    gives the reference tokens."""
    await wait_serving_again(nc, mesh, host, healed_at)
    await asyncio.to_thread(mesh.stop_shard, replica)
    again = await stream_with_action(nc, chat_request())
    assert again.final.type == "done", again.final
    assert host.shard_id in again.first_hops
    assert again.token_ids == reference.token_ids


async def test_a_flapping_household_link_leaves_the_tokens_and_the_host_serving(bed, mesh, reference, nc):
    flapping = mesh.shards["p1"]
    # The cut test before this one stopped the middle range's replica: a fresh one takes over if a flap is noticed.
    replica = await asyncio.to_thread(start_household_shard, bed, mesh, "r1", PLACEMENT["r1"])
    await asyncio.to_thread(mesh.cluster.wait_ready, replica.process)
    await mesh.wait_advertised(replica)
    await mesh.wait_idle_in_routing(flapping)

    async def flap() -> None:
        for _ in range(FLAPS):
            await asyncio.to_thread(bed.cut, CUT_HOUSEHOLD)
            await asyncio.sleep(flap_down_s)
            await asyncio.to_thread(bed.heal, CUT_HOUSEHOLD)
            await asyncio.sleep(flap_up_s)

    flapper: list[asyncio.Task] = []
    try:
        call = await stream_with_action(nc, chat_request(), lambda: flapper.append(asyncio.create_task(flap())))
        await flapper[0]
    finally:
        for task in flapper:
            task.cancel()
        bed.heal(CUT_HOUSEHOLD)
        healed_at = time.monotonic()
    failed = [f.failed_shard_id for f in call.of_type("shard_failover")]
    print(f"flapping link: {len(failed)} failovers, longest pause between tokens {call.longest_token_gap_s():.2f} s")

    assert flapping.process.alive
    assert call.final.type == "done", call.final
    assert set(failed) <= {flapping.shard_id}, failed  # only the flapping household's host was ever given up
    assert call.token_ids == reference.token_ids

    # Healed: with the replica gone, a new call can only run through the host whose link flapped.
    await answers_alone_once_healed(nc, mesh, flapping, replica, reference, healed_at)
