"""KeptInputs (hearth/services/orchestrator/kept_inputs.py): what entered each hop over a kept prefix is found by any of
its blocks' names, cut to the positions asked, combined with a later chain's record, and dropped beyond its budget."""

from __future__ import annotations

import torch

from hearth.protocol.control import PrefixBlocks
from hearth.services.orchestrator.kept_inputs import KeptInputs, chain_layer_inputs, first_blocks

NAMES = [f"{i:032x}" for i in range(6)]


def blocks(count: int, block_tokens: int = 2) -> PrefixBlocks:
    return PrefixBlocks(block_tokens=block_tokens, hashes=NAMES[:count])


def test_inputs_are_found_by_any_block_s_name_and_cut_to_its_positions():
    kept = KeptInputs(budget_bytes=1 << 20)
    layer_2 = torch.arange(10.0).reshape(1, 10, 1)
    kept.keep(blocks(4), {2: layer_2})
    assert torch.equal(kept.inputs(blocks(3), 2), layer_2[:, :6])
    assert kept.inputs(blocks(3), 4) is None  # no hop began at layer 4
    assert kept.inputs(blocks(5), 2) is None  # more blocks than kept
    assert kept.inputs(PrefixBlocks(block_tokens=2, hashes=["f" * 32]), 2) is None


def test_a_later_chain_s_record_follows_the_kept_inputs_of_its_prefix():
    kept = KeptInputs(budget_bytes=1 << 20)
    kept.keep(blocks(2), {2: torch.zeros(1, 4, 1), 4: torch.ones(1, 4, 1)})
    recorded = [None, torch.full((1, 3, 1), 7.0), torch.full((1, 3, 1), 9.0)]
    inputs = chain_layer_inputs(kept, blocks(3), 4, [0, 2, 4], recorded)
    assert sorted(inputs) == [2, 4]
    assert inputs[2].flatten().tolist() == [0, 0, 0, 0, 7, 7, 7]
    # A chain that began at 0 needs nothing kept; a hole in the record keeps nothing for that layer.
    assert chain_layer_inputs(kept, None, 0, [0, 2, 4], [None, recorded[1], None]).keys() == {2}
    assert first_blocks(blocks(5), 7).hashes == NAMES[:3]


def test_the_least_recently_used_entries_go_beyond_the_budget():
    one_entry = 4 * 4  # four float32 positions of one layer
    kept = KeptInputs(budget_bytes=one_entry)
    kept.keep(blocks(2), {2: torch.zeros(1, 4, 1)})
    kept.keep(PrefixBlocks(block_tokens=2, hashes=NAMES[3:5]), {2: torch.zeros(1, 4, 1)})
    assert kept.inputs(blocks(2), 2) is None and kept.total_bytes == one_entry


def test_an_earlier_turn_no_name_reaches_any_more_is_dropped_before_another_conversation_s_live_entry():
    def conversation(tag: str, count: int) -> PrefixBlocks:
        return PrefixBlocks(block_tokens=2, hashes=[f"{tag}{i:031x}" for i in range(count)])

    entry_bytes = 4 * 2 * 4  # 4 blocks of 2 positions, one float32 each
    kept = KeptInputs(budget_bytes=3 * entry_bytes)
    kept.keep(conversation("b", 2), {2: torch.zeros(1, 4, 1)})  # another conversation, kept first
    for turn in range(1, 4):  # each turn's blocks hold every earlier turn's
        kept.keep(conversation("a", turn), {2: torch.ones(1, 2 * turn, 1)})
    assert kept.inputs(conversation("b", 2), 2) is not None
    assert kept.inputs(conversation("a", 3), 2) is not None
    assert kept.total_bytes == (2 + 3) * 2 * 4  # the earlier turns' entries are gone


def test_an_entry_larger_than_the_whole_budget_is_not_kept_and_pushes_out_nothing():
    # A very long history's inputs alone beyond `kept_inputs_mb`: keeping it would push out every other conversation's
    # entry (least recently used first) and then itself, leaving their kept-prefix hops unchecked for nothing.
    kept = KeptInputs(budget_bytes=4 * 4)
    kept.keep(blocks(2), {2: torch.zeros(1, 4, 1)})
    kept.keep(PrefixBlocks(block_tokens=2, hashes=NAMES[3:6]), {2: torch.zeros(1, 6, 1)})
    assert kept.inputs(blocks(2), 2) is not None
    assert kept.inputs(PrefixBlocks(block_tokens=2, hashes=NAMES[3:6]), 2) is None
    assert kept.total_bytes == 4 * 4
