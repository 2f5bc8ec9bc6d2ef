"""Kept blocks are named per hop behind the hops before it: a later hop keeps and attaches a call's blocks under names
bound to the shard ids and layers upstream of it, so KV it kept is attached again only behind the very hosts whose
activations computed it (not behind a replica, nor once one of them is proved wrong and routed around), while the
first hop keeps the call's own names."""

from __future__ import annotations

from types import SimpleNamespace

from pydantic import TypeAdapter

from hearth.protocol.control import CloseHop, ControlReply, ControlRequest, KeepHop, OpenHop, PrefixBlocks
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.prefix import behind_hops
from hearth.services.orchestrator.router import Hop

REQUEST = TypeAdapter(ControlRequest)
BLOCKS = PrefixBlocks(block_tokens=4, hashes=["0" * 31 + "1", "0" * 31 + "2"])


class ControlNats:
    """Just enough of a NATS client to open, keep and close a chain's hops, recording what each hop was told."""

    max_payload = 1024 * 1024

    def __init__(self) -> None:
        self.told: list[tuple[str, OpenHop | KeepHop | CloseHop]] = []

    async def request(self, subject: str, data: bytes, timeout: float, headers: dict | None = None):
        self.told.append((subject, REQUEST.validate_json(data)))
        return SimpleNamespace(data=ControlReply(ok=True).model_dump_json().encode())

    async def publish(self, subject: str, data: bytes, **_: object) -> None:
        self.told.append((subject, REQUEST.validate_json(data)))

    async def flush(self, timeout: float | None = None) -> None:
        return None


def chain_over(nc: ControlNats, middle: str) -> HopChain:
    hops = [Hop("m:0-1@a", "c.a", "a", 0, 1), Hop(f"m:2-3@{middle}", f"c.{middle}", middle, 2, 3),
            Hop("m:4-5@d", "c.d", "d", 4, 5)]
    return HopChain(nc, f"p-{middle}", hops, node_id="orch", model_id="m", weights_sha256="w",
                    transport=TransportSettings(), prefix=BLOCKS)


async def told_names(middle: str) -> dict[str, dict[str, list[str]]]:
    """Per hop's control subject, the names its open, keep and close carried."""
    nc = ControlNats()
    chain = chain_over(nc, middle)
    for index, hop in enumerate(chain.hops):
        await chain._open_hop(index, hop)
    chain._open_sent = True
    await chain.keep_now(BLOCKS)
    await chain.close(keep=BLOCKS)
    names: dict[str, dict[str, list[str]]] = {}
    for subject, message in nc.told:
        blocks = message.prefix if isinstance(message, OpenHop) else message.keep
        names.setdefault(subject, {})[type(message).__name__] = blocks.hashes
    return names


async def test_each_hop_keeps_and_attaches_under_the_same_names_the_first_under_the_calls_own():
    names = await told_names("liar")
    assert set(names) == {"c.a", "c.liar", "c.d"}
    for subject, told in names.items():
        assert told["OpenHop"] == told["KeepHop"] == told["CloseHop"], subject
    assert names["c.a"]["OpenHop"] == BLOCKS.hashes
    assert len({tuple(told["OpenHop"]) for told in names.values()}) == 3


async def test_a_hop_behind_another_host_finds_nothing_the_first_hop_still_finds_its_blocks():
    through_liar, through_replica = await told_names("liar"), await told_names("replica")
    assert through_liar["c.a"] == through_replica["c.a"]
    assert through_liar["c.d"]["OpenHop"] != through_replica["c.d"]["OpenHop"]
    for told in (through_liar, through_replica):
        assert all(len(name) == 32 for name in told["c.d"]["OpenHop"])


def test_the_hops_layers_count_too_and_no_blocks_stay_none():
    hops = [Hop("m:0-3@a", "c.a", "a", 0, 1), Hop("m:0-7@d", "c.d", "d", 2, 7)]
    wider = [Hop("m:0-3@a", "c.a", "a", 0, 2), Hop("m:0-7@d", "c.d", "d", 3, 7)]
    assert behind_hops(BLOCKS, hops, 1) != behind_hops(BLOCKS, wider, 1)
    assert behind_hops(None, hops, 1) is None and behind_hops(BLOCKS, hops, 0) is BLOCKS
