"""What the orchestrator keeps per conversation beside its shards' kept prefixes (kept inputs, kept chains' names;
hearth/services/orchestrator/kept_expiry.py) goes once unused for the shards' `prefix_cache_idle_s`, as the blocks it
stands for do: lazily on access, and by the periodic sweep, so memory comes back after a burst of conversations."""

from __future__ import annotations

import asyncio

import torch

from hearth.protocol.control import PrefixBlocks
from hearth.services.orchestrator.kept_expiry import sweep_expired, sweep_interval_s
from hearth.services.orchestrator.kept_inputs import KeptInputs
from hearth.services.orchestrator.prefix import KeptChains


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def conversation(tag: str, count: int) -> PrefixBlocks:
    return PrefixBlocks(block_tokens=2, hashes=[f"{tag}{i:031x}" for i in range(count)])


def test_kept_inputs_unused_for_the_shards_idle_time_are_dropped_on_access():
    clock = Clock()
    kept = KeptInputs(budget_bytes=1 << 20, idle_s=600, clock=clock)
    kept.keep(conversation("a", 2), {2: torch.zeros(1, 4, 1)})
    kept.keep(conversation("b", 2), {2: torch.zeros(1, 4, 1)})
    clock.now_s += 400
    assert kept.inputs(conversation("b", 2), 2) is not None  # a use: `b` is kept another 600 s from now
    clock.now_s += 201
    assert kept.inputs(conversation("a", 2), 2) is None  # its shards dropped the blocks 1 s ago
    assert kept.inputs(conversation("b", 2), 2) is not None
    assert kept.total_bytes == 4 * 4 and len(kept) == 1


def test_kept_chains_names_unused_for_the_shards_idle_time_are_forgotten_on_access():
    clock = Clock()
    chains = KeptChains(idle_s=600, clock=clock)
    chains.remember(["n0", "n1"], [("a", 0, 5)])
    clock.now_s += 300
    chains.remember(["n0", "n1", "n2"], [("b", 0, 5)])  # a next turn: every name again, on `b`
    chains.remember(["m0"], [("c", 0, 5)])
    clock.now_s += 301
    assert chains.holding(["n0", "n1", "n2"]).hops == (("b", 0, 5),)
    clock.now_s += 300
    assert chains.holding(["n0", "n1", "n2"]) is None and chains.holding(["m0"]) is None
    assert len(chains) == 0


async def test_the_sweep_gives_the_memory_of_a_burst_back_without_any_access_and_ends_when_cancelled():
    clock = Clock()
    kept = KeptInputs(budget_bytes=1 << 20, idle_s=600, clock=clock)
    chains = KeptChains(idle_s=600, clock=clock)
    for index in range(50):  # a burst of conversations, then none
        blocks = PrefixBlocks(block_tokens=2, hashes=[f"{index:02x}{i:030x}" for i in range(3)])
        kept.keep(blocks, {2: torch.zeros(1, 6, 8)})
        chains.remember(blocks.hashes, [("a", 0, 5)])
    assert len(kept) == 50 and len(chains) == 150
    clock.now_s += 601
    sweep = asyncio.create_task(sweep_expired([kept, chains], every_s=0.01))
    try:
        async with asyncio.timeout(5):
            while len(kept) or len(chains):
                await asyncio.sleep(0.01)
        assert kept.total_bytes == 0
    finally:
        sweep.cancel()
        await asyncio.gather(sweep, return_exceptions=True)
    assert sweep.cancelled()


def test_no_idle_time_given_keeps_entries_until_their_caps_and_the_sweep_interval_is_bounded():
    clock = Clock()
    kept, chains = KeptInputs(budget_bytes=1 << 20, clock=clock), KeptChains(clock=clock)
    kept.keep(conversation("a", 2), {2: torch.zeros(1, 4, 1)})
    chains.remember(["n0"], [("a", 0, 5)])
    clock.now_s += 10**7
    assert kept.inputs(conversation("a", 2), 2) is not None and chains.holding(["n0"]) is not None
    # Shards keeping nothing (0) or blocks for days: memory still comes back within a minute of their expiry.
    assert 0 < sweep_interval_s(0) <= sweep_interval_s(600) <= 60 and sweep_interval_s(86400) == 60
