"""KeptInputs: what entered each layer boundary over a kept prefix's positions, held in this orchestrator's memory
(never persisted) beside the blocks its shards kept, so that a hop which begins from a kept prefix can still be
checked: its mirror is first fed those positions, building the same KV from the same inputs, then checked on the
positions the call ran (hearth/services/orchestrator/verification.py, mirror.py).

Without them a shard could lie only in sessions it began from kept KV, where no mirror could follow it. The input to
layer 0 is the tokens' embedding, which the orchestrator computes itself; the input to a later hop's first layer is
what the hop before sent, recorded by the chain's taps (hearth/services/orchestrator/recording.py) and kept when the
call ended well, for every layer where one of its hops began. Entries are found by any of their blocks' names (a later
turn's prefix is an earlier turn's whole), least recently used dropped beyond `[verification] kept_inputs_mb`, and
any unused for the shards' `[shard] prefix_cache_idle_s` dropped as its blocks are (kept_expiry.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hearth.protocol.control import PrefixBlocks
from hearth.services.orchestrator.kept_expiry import IdleExpiry, pop_expired

# How long a call's end waits for its taps to file their last steps: they came before its output, so only a tap that
# missed one waits this long (its running place is held meanwhile).
tap_settle_s = 1.0


@dataclass
class _Entry:
    positions: int
    # Layer index -> [1, positions, hidden]: what entered that layer.
    inputs: dict[int, torch.Tensor]
    names: tuple[str, ...] = ()
    last_used_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs.values())


class KeptInputs:
    """Layer inputs over kept prefixes, by block name."""

    def __init__(self, budget_bytes: int, *, idle_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`idle_s`: how long the shards keep blocks unused (`[shard] prefix_cache_idle_s`; None: entries go only
        beyond the budget)."""
        self.budget_bytes = budget_bytes
        self._expiry = IdleExpiry(idle_s, clock)
        # By the name of an entry's last block, least recently used first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_name: dict[str, tuple[str, int]] = {}  # any block's name -> (entry key, blocks up to it)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def inputs(self, prefix: PrefixBlocks, layer: int) -> torch.Tensor | None:
        """What entered `layer` over the positions of `prefix`'s blocks, or None when not kept."""
        self.drop_expired()
        if not prefix.hashes:
            return None
        found = self._by_name.get(prefix.hashes[-1])
        if found is None or found[0] not in self._entries:
            return None
        key, blocks = found
        entry = self._entries[key]
        entry.last_used_s = self._expiry.clock()
        self._entries.move_to_end(key)
        tensor = entry.inputs.get(layer)
        positions = blocks * prefix.block_tokens
        if tensor is None or blocks != len(prefix.hashes) or tensor.shape[1] < positions:
            return None
        return tensor[:, :positions]

    def keep(self, kept: PrefixBlocks, inputs: dict[int, torch.Tensor]) -> None:
        """Hold `inputs` (per layer, at least the positions of `kept`'s blocks) under those blocks' names; not when they
        alone exceed the budget."""
        positions = len(kept.hashes) * kept.block_tokens
        trimmed = {layer: tensor[:, :positions] for layer, tensor in inputs.items() if tensor.shape[1] >= positions}
        if not kept.hashes or not trimmed or _Entry(positions, trimmed).nbytes > self.budget_bytes:
            return  # one beyond the whole budget would push out every other entry, then itself
        self.drop_expired()
        entry = _Entry(positions, {layer: tensor.clone() for layer, tensor in trimmed.items()}, tuple(kept.hashes),
                       self._expiry.clock())
        key = kept.hashes[-1]
        superseded = {self._by_name[name][0] for name in kept.hashes if name in self._by_name} - {key}
        self._entries[key] = entry
        self._entries.move_to_end(key)
        for blocks, name in enumerate(kept.hashes, start=1):
            self._by_name[name] = (key, blocks)
        # An earlier turn's entry whose every name the new one took over is reached by nothing any more: drop it now,
        # not after the live entries of other conversations the budget would push out first.
        reached = {owner for owner, _ in self._by_name.values()} if superseded else set()
        for old_key in superseded - reached:
            self._entries.pop(old_key, None)
        while self._entries and self.total_bytes > self.budget_bytes:
            self._forget(*self._entries.popitem(last=False))

    def drop_expired(self, limit: int | None = None) -> int:
        """Drop the entries unused for the shards' idle time (at most `limit`); how many."""
        dropped = pop_expired(self._entries, lambda entry: entry.last_used_s, self._expiry, limit)
        for key, entry in dropped:
            self._forget(key, entry)
        return len(dropped)

    def _forget(self, key: str, entry: _Entry) -> None:
        for name in entry.names:
            if self._by_name.get(name, (None,))[0] == key:
                del self._by_name[name]


def chain_layer_inputs(kept_inputs: KeptInputs, prefix: PrefixBlocks | None, reused_tokens: int,
                       hop_layers: Sequence[int], recorded: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """Per first layer of the chain's hops after the first: what entered it from position 0, the kept prefix's
    inputs (when the chain began from one) followed by what its taps recorded (`recorded[i]`: hop i's inputs from
    `reused_tokens` on; None where the record has a hole)."""
    layer_inputs = {}
    for layer, tail in zip(hop_layers[1:], recorded[1:]):
        if tail is None or layer == 0:
            continue
        if reused_tokens:
            head = kept_inputs.inputs(first_blocks(prefix, reused_tokens), layer) if prefix is not None else None
            if head is None:
                continue
            tail = torch.cat([head, tail], dim=1)
        layer_inputs[layer] = tail
    return layer_inputs


def first_blocks(prefix: PrefixBlocks, positions: int) -> PrefixBlocks:
    """The blocks of `prefix` within its first `positions` positions."""
    return PrefixBlocks(block_tokens=prefix.block_tokens, hashes=prefix.hashes[:positions // prefix.block_tokens])


async def keep_chain_inputs(kept_inputs: KeptInputs, chain, kept: PrefixBlocks) -> None:
    """Keep what entered each of `chain`'s hops (a HopChain of a call that ended well) over the blocks of `kept`; a
    tap that has not filed every step within `tap_settle_s` leaves its hop's layer out."""
    recorder = chain.recorder
    latest = recorder.latest_step() if recorder is not None else None
    if latest is None or kept_inputs.budget_bytes <= 0 or len(chain.hops) < 2:
        return
    later_hops = range(1, len(chain.hops))
    await recorder.settled(latest, tap_settle_s, hops=set(later_hops))
    recorded: list[torch.Tensor | None] = [None]
    for index in later_hops:
        span = recorder.span(index, chain.reused_tokens, latest)
        recorded.append(span.inputs if span is not None else None)
    kept_inputs.keep(kept, chain_layer_inputs(kept_inputs, chain.prefix, chain.reused_tokens,
                                              [hop.layer_lo_to_run for hop in chain.hops], recorded))
