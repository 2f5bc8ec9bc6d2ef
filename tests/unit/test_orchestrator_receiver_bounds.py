"""The orchestrator's own receivers (its sink after a chain's last hop, and the taps that record the links between
hops) take the `[transport]` receiver bounds, as every shard's hop does: a configured bound is not the shards' alone."""

from __future__ import annotations

from types import SimpleNamespace

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.recording import tap_ready_steps
from hearth.services.orchestrator.router import Hop

configured = dict(max_ready_steps=3, ready_wait_timeout_s=1.5, max_step_bytes=2**18, max_partial_steps=5,
                  max_tracked_sessions=7)


def _hop(index: int) -> Hop:
    return Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.node{index}.shard-{index}",
               node_id=f"node{index}", layer_lo_to_run=index, layer_hi_to_run=index)


def _chain() -> HopChain:
    # Nothing is subscribed before `open`: building a chain reads only the connection's max_payload.
    connection = SimpleNamespace(max_payload=2**20)
    return HopChain(connection, "pipe", [_hop(0), _hop(1)], node_id="orchestrator", model_id="tiny",
                    weights_sha256="0" * 64, transport=TransportSettings(**configured), hidden_size=64,
                    max_session_tokens=128, record_budget_bytes=2**20)


def test_the_sink_takes_the_transport_receiver_bounds():
    sink = _chain()._sink
    assert sink.max_ready_steps == configured["max_ready_steps"]
    assert sink.ready_wait_timeout_s == configured["ready_wait_timeout_s"]
    # Within the pipeline's own bound (128 positions x 64 x 5 bytes) the configured one is the smaller.
    assert sink.max_step_bytes == min(configured["max_step_bytes"], 128 * 64 * 5)
    assert sink.max_partial_steps == configured["max_partial_steps"]
    assert sink.max_tracked_sessions == configured["max_tracked_sessions"]


def test_the_taps_take_the_transport_receiver_bounds_but_hold_every_step():
    chain = _chain()
    (tap,) = chain.recorder._taps
    assert tap.max_partial_steps == configured["max_partial_steps"]
    assert tap.max_tracked_sessions == configured["max_tracked_sessions"]
    assert tap.ready_wait_timeout_s == configured["ready_wait_timeout_s"]
    assert tap.max_step_bytes == min(configured["max_step_bytes"], 128 * 64 * 5)
    assert tap.max_ready_steps == tap_ready_steps  # a tap has no backpressure: it never drops a recorded step
