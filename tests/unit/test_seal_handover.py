"""The orchestrator hands each hop the sealing mode with its link keys: sealed by default, MAC-only when
`[transport] seal_activations` is false, and never sealed without link keys (`activation_macs = false`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hearth.protocol.control import ControlReply, OpenHop
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.router import Hop


class RecordingNats:
    """Just enough of a NATS client to build a chain and answer its `open` requests."""

    max_payload = 1024 * 1024

    def __init__(self) -> None:
        self.opens: list[OpenHop] = []

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict | None = None) -> SimpleNamespace:
        self.opens.append(OpenHop.model_validate_json(data))
        return SimpleNamespace(data=ControlReply(ok=True).model_dump_json().encode())


async def opens_of(transport: TransportSettings) -> list[OpenHop]:
    nc = RecordingNats()
    hops = [Hop(f"s{i}", f"hearth.ctl.n{i}.s{i}", f"n{i}", 2 * i, 2 * i + 1) for i in range(3)]
    chain = HopChain(nc, "p-seal", hops, node_id="orch", model_id="m", weights_sha256="w", transport=transport)
    for index, hop in enumerate(hops):
        await chain._open_hop(index, hop)
    return nc.opens


@pytest.mark.parametrize("sealed", [True, False])
async def test_every_hop_is_told_the_mode_with_the_keys_of_both_its_links(sealed):
    opens = await opens_of(TransportSettings(seal_activations=sealed))
    assert [request.seal_activations for request in opens] == [sealed] * 3
    # Hop i's outbound link is hop i+1's inbound link: both ends hold the same key (and so the same seal key).
    assert all(request.inbound_link_key and request.outbound_link_key for request in opens)
    assert [request.outbound_link_key for request in opens[:-1]] == [request.inbound_link_key for request in opens[1:]]


def test_sealing_is_on_by_default():
    assert TransportSettings().seal_activations


async def test_without_link_keys_no_hop_is_asked_to_seal():
    opens = await opens_of(TransportSettings(activation_macs=False))
    assert [(request.seal_activations, request.inbound_link_key) for request in opens] == [(False, None)] * 3


async def shard_answer_to(open_request: OpenHop, *, host_seals: bool) -> ControlReply:
    """What a shard configured with `host_seals` answers an open that it refuses before serving anything."""
    from hearth.services.shard.server import ShardServer

    server = ShardServer.__new__(ShardServer)  # only what _open_hop reads before it serves
    server.identity = SimpleNamespace(model_id="m", weights_sha256="w", quantization="none", layer_lo=0, layer_hi=7,
                                      node_id="n0")
    server.requires_sealing = host_seals
    server.compute = SimpleNamespace(runner=SimpleNamespace(info=SimpleNamespace(max_positions=None)))
    server._hops = {}
    server._hop_changes = asyncio.Lock()
    server._withdrawn = False
    server.steward_keys = None  # an open mesh's: no key retired by the log
    server.settings = SimpleNamespace(max_concurrent_streams=0)  # a sound open is then refused as at_capacity
    return await server._open_hop(open_request)


async def test_a_shard_that_seals_refuses_an_open_in_clear_with_link_keys():
    clear, sealed = (await opens_of(TransportSettings(seal_activations=False)))[0], \
        (await opens_of(TransportSettings()))[0]
    assert (await shard_answer_to(clear, host_seals=True)).code == "bad_request"
    assert (await shard_answer_to(sealed, host_seals=True)).code == "at_capacity"
    assert (await shard_answer_to(clear, host_seals=False)).code == "at_capacity"
