"""A call already running on a shard host that the roster or the event log says was removed (or whose key was rotated
away) moves off it at its next step, failed over as for a host that died (`gone`): a broker that still admits the host
(another broker, an older roster there) would otherwise let it compute, and see, the rest of the call. Before, only new
calls avoided it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind

HOPS = [Hop(shard_id=f"shard-{index}", control_subject=f"hearth.ctl.n{index}.shard-{index}", node_id=f"n{index}",
            layer_lo_to_run=index, layer_hi_to_run=index) for index in range(2)]


class _Connection(SimpleNamespace):
    """Takes the step's frames (what a broker would) and keeps them."""

    async def publish(self, subject: str, payload: bytes, headers=None) -> None:
        self.published.append(subject)


def _chain(removed: dict[str, str]) -> tuple[HopChain, _Connection]:
    connection = _Connection(max_payload=2**20, stats={"reconnects": 0}, is_connected=True, published=[])
    chain = HopChain(connection, "pipe", HOPS, node_id="orchestrator", model_id="tiny", weights_sha256="0" * 64,
                     transport=TransportSettings(), hidden_size=8, max_session_tokens=16,
                     why_not_a_member=removed.get)
    return chain, connection


async def test_the_next_step_of_a_call_on_a_removed_host_fails_over_as_for_a_dead_one():
    removed: dict[str, str] = {}
    chain, connection = _chain(removed)
    removed["n1"] = "its member's key was removed or rotated (the event log says so; this roster copy not yet)"
    failure = await chain.send_step(FrameKind.decode, 3, torch.zeros(1, 1, 8))
    assert isinstance(failure, StepFailure), failure
    assert (failure.kind, failure.shard_id) == ("gone", "shard-1")
    assert "n1 may not serve" in failure.reason and "event log" in failure.reason
    assert not connection.published  # nothing of the step went out to the removed host's chain
    assert failure.verified  # routed around for the call, and said, as a dead host is


def test_a_chain_whose_hosts_are_members_finds_none_removed():
    chain, _ = _chain({"another-node": "its member was removed from the community"})
    assert chain._removed_hop() is None
