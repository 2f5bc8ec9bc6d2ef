"""PrefixCache: the KV of ended sessions of one layer range, kept by chained block hashes, so that a later session
whose tokens begin the same way starts where they left off (idle TTL, least-recently-used eviction).

The orchestrator names each full block of `block_tokens` tokens by a hash chained over every token before it and
over what it ran them with (model, weights, scheme, wire dtype, caller scope: hearth/services/orchestrator/prefix.py);
the shard only keys those names by the layers it ran and by who opened the hop (`prefix_keys`), since KV of layers 3-5
cannot stand in for 0-5, and a shard cannot tell KV computed from a name's tokens from junk kept under it: on a
community mesh only hops a member opened may attach what its hops kept (anyone's where opens are not told apart).
An entry holds the keys and values of its first `tokens` positions for every layer of the run, copied out of the
session's cache; a lookup returns the entry holding the longest run of the asked blocks, and `attach` copies its
first blocks into a new session's cache through the cache's own `update`, so sliding-window layers keep their
bookkeeping. Only caches whose every layer still holds every position from 0 are kept (a sliding window that dropped
positions cannot be cut back to a block boundary).

Dynamic and static caches alike (a GPU's, hearth/inference/static_decode.py): an entry holds only its positions, copied
out of the session's cache, so a kept prefix takes its tokens' bytes, not a whole static cache; attaching one writes
them into the new session's static cache in place (its addresses, and so its graphs' inputs, stay fixed). How many
positions a cache holds is asked of `CacheLengths`: a static cache's tensors always span every position, so only its
decoder knows how many are filled.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


# Per layer index: the keys and values of the first positions.
KeysValues = dict[int, tuple[torch.Tensor, torch.Tensor]]


def prefix_keys(block_hashes: Sequence[str], run_lo: int, run_hi: int, block_tokens: int,
                opener: str | None = None) -> list[str]:
    """The shard's own keys for the orchestrator's block hashes: the same blocks run over other layers, or cut into
    other block sizes, are other KV, and blocks kept by hops of one `opener` (the member whose signed `open` the hop
    answered; None on an open mesh) are found by that opener's hops only."""
    # Member names hold no NUL: no opener's salt is another's.
    salt = f"{run_lo}-{run_hi}/{block_tokens}:".encode() if opener is None else \
        f"{run_lo}-{run_hi}/{block_tokens}\0opener\0{opener}\0:".encode()
    return [hashlib.blake2b(salt + block_hash.encode(), digest_size=16).hexdigest() for block_hash in block_hashes]


@dataclass
class PrefixEntry:
    """The KV of one ended session's first `tokens` positions (`keys[i]` names its first i+1 blocks)."""

    keys: tuple[str, ...]
    kv: KeysValues
    tokens: int
    nbytes: int
    last_used_s: float
    block_tokens: int = field(default=0)
    opener: str | None = None  # whose hops kept it (prefix_keys)


class CacheLengths:
    """How many leading positions a dynamic cache's layer holds, and setting that after a fill or a cut (the
    cache's own counters suffice)."""

    def held(self, cache, layer_index: int) -> int | None:
        """Positions 0.. the layer holds, None when it holds none or no longer every one from 0 (a sliding window)."""
        layer = cache.layers[layer_index]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return None
        length = layer.get_seq_length()
        return length if length == keys.shape[-2] else None

    def cut(self, cache, layers: range, tokens: int) -> None:
        """Drop every position from `tokens` on in `layers`."""
        for layer_index in layers:
            layer = cache.layers[layer_index]
            if getattr(layer, "is_initialized", False) and int(layer.get_seq_length()) > tokens:
                layer.crop(tokens - int(layer.get_seq_length()))

    def filled(self, cache, layers: range, tokens: int) -> None:
        """Note that `layers` hold `tokens` positions after a fill (a dynamic cache counts them itself)."""


def cache_snapshot(cache, layers: range, tokens: int, lengths: CacheLengths,
                   max_bytes: int | None = None) -> KeysValues | None:
    """Copies of the first `tokens` positions' keys and values of `layers`, or None when some layer no longer holds
    every position up to `tokens` (a sliding window dropped some) or holds none, or they would take over `max_bytes`."""
    views = {}
    for layer_index in layers:
        held = lengths.held(cache, layer_index)
        if held is None or held < tokens:
            return None
        layer = cache.layers[layer_index]
        views[layer_index] = (layer.keys[..., :tokens, :], layer.values[..., :tokens, :])
    if max_bytes is not None and sum(k.nbytes + v.nbytes for k, v in views.values()) > max_bytes:
        return None
    return {layer_index: (keys.clone(), values.clone()) for layer_index, (keys, values) in views.items()}


def fill_cache(cache, kv: KeysValues, tokens: int, lengths: CacheLengths) -> None:
    """Put the first `tokens` positions of `kv` into an empty `cache` through its own `update`; the entry stays as it
    was (a dynamic layer joins what it is given into a new tensor, a static one copies it into its own)."""
    for layer_index, (keys, values) in kv.items():
        cache.update(keys[..., :tokens, :], values[..., :tokens, :], layer_index)
    lengths.filled(cache, range(min(kv), max(kv) + 1), tokens)


class PrefixCache:
    """Entries by key, least recently used first; not thread-safe on its own (the runner locks)."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._owner: dict[str, int] = {}  # key -> number of the entry holding that block (the newest one)
        self._numbers = itertools.count()
        self.hits_total = 0
        self.misses_total = 0
        self.evictions_total = 0
        self.reused_tokens_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def lookup(self, keys: Sequence[str]) -> tuple[PrefixEntry, int] | None:
        """The entry holding the most leading blocks of `keys`, each of them, and how many (counted as a hit or a
        miss), or None."""
        for blocks in range(len(keys), 0, -1):
            entry_id = self._owner.get(keys[blocks - 1])
            # Every block up to it must be the entry's own: one name alone, its predecessors junk, opens nothing.
            if entry_id is not None and self._entries[entry_id].keys[:blocks] == tuple(keys[:blocks]):
                entry = self._entries[entry_id]
                entry.last_used_s = self._clock()
                self._entries.move_to_end(entry_id)
                self.hits_total += 1
                self.reused_tokens_total += blocks * entry.block_tokens
                return entry, blocks
        if keys:
            self.misses_total += 1
        return None

    def put(self, keys: Sequence[str], kv: KeysValues, block_tokens: int, opener: str | None = None) -> None:
        """Keep `kv` (the first len(keys) blocks' positions) under `keys`, for hops of `opener`; entries whose every
        block the new one holds too are dropped (a conversation's next turn holds its earlier turns)."""
        nbytes = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in kv.values())
        entry = PrefixEntry(keys=tuple(keys), kv=kv, tokens=len(keys) * block_tokens, nbytes=nbytes,
                            last_used_s=self._clock(), block_tokens=block_tokens, opener=opener)
        entry_id = next(self._numbers)
        superseded = {self._owner[key] for key in keys if key in self._owner}
        self._entries[entry_id] = entry
        for key in keys:
            self._owner[key] = entry_id
        for old_id in superseded:
            if not any(self._owner.get(key) == old_id for key in self._entries[old_id].keys):
                del self._entries[old_id]

    def evict_expired(self) -> int:
        """Drop entries unused for longer than the TTL; the bytes freed."""
        deadline = self._clock() - self.ttl_s
        return sum(self._evict(entry_id) for entry_id, entry in list(self._entries.items())
                   if entry.last_used_s < deadline)

    def evict_oldest(self) -> int:
        """Drop the least recently used entry; the bytes freed (0 when empty)."""
        return self._evict(next(iter(self._entries))) if self._entries else 0

    def drop_opener(self, opener: str) -> int:
        """Drop every entry hops of `opener` kept (its member was removed, or its key retired); the bytes freed."""
        return sum(self._evict(entry_id, counted=False) for entry_id, entry in list(self._entries.items())
                   if entry.opener == opener)

    def clear(self) -> int:
        freed = self.total_bytes
        self._entries.clear()
        self._owner.clear()
        return freed

    def _evict(self, entry_id: int, counted: bool = True) -> int:
        """Drop an entry; `counted`: as an eviction (idle, or making room), the metric's."""
        entry = self._entries.pop(entry_id)
        for key in entry.keys:
            if self._owner.get(key) == entry_id:
                del self._owner[key]
        self.evictions_total += counted
        return entry.nbytes


class PrefixSessions:
    """Attaching kept prefixes to new sessions and keeping ended sessions' caches (the runner's lock held)."""

    def __init__(self, caches, prefixes: PrefixCache, lengths: CacheLengths) -> None:
        self.caches = caches  # the runner's SessionCaches
        self.prefixes = prefixes
        self.lengths = lengths

    def attach(self, session_id: str, block_hashes: Sequence[str], block_tokens: int, run_lo: int,
               run_hi: int, opener: str | None = None) -> int:
        """Start `session_id` afresh and copy into it the longest prefix of the blocks named that hops of `opener`
        kept; the positions it holds now (0 when none is kept)."""
        session = self.caches.start(session_id)
        self.prefixes.evict_expired()
        found = self.prefixes.lookup(prefix_keys(block_hashes, run_lo, run_hi, block_tokens, opener))
        if found is None:
            return 0
        entry, blocks = found
        tokens = blocks * block_tokens
        fill_cache(session.cache, entry.kv, tokens, self.lengths)
        self.caches.record_use(session_id)
        session.attached_tokens = tokens
        self.caches.enforce_budget(keep=session_id)
        return tokens

    def keep(self, session_id: str, block_hashes: Sequence[str], block_tokens: int, run_lo: int, run_hi: int,
             cached_tokens: int, end_session: bool = True, opener: str | None = None) -> int:
        """Keep the session's first blocks (those it holds whole of the ones named) as a prefix for hops of `opener`,
        ending the session (its cache freed) unless `end_session` is False; the positions kept (none when they alone
        would not fit the budget beside the live sessions)."""
        session = self.caches.pop(session_id) if end_session else self.caches.get(session_id)
        blocks = min(len(block_hashes), cached_tokens // block_tokens)
        if session is None or blocks < 1:
            return 0
        # Never more than the room the live sessions leave: kept, it would push out every other kept prefix, then
        # itself (a session's copy kept while it goes on).
        room = self.caches.budget_bytes - self.caches.total_bytes
        kv = cache_snapshot(session.cache, range(run_lo, run_hi + 1), blocks * block_tokens, self.lengths, room)
        if kv is None:
            return 0
        keys = prefix_keys(block_hashes[:blocks], run_lo, run_hi, block_tokens, opener)
        self.prefixes.put(keys, kv, block_tokens, opener)
        self.caches.enforce_budget()
        return blocks * block_tokens

    def cut_back(self, session, start_pos: int, layers: range) -> bool:
        """A session's first step after an attach may start before the prefix's end (another hop holds less of
        it): cut the cache back to `start_pos`. Whether it did."""
        if not session.attached_tokens or start_pos >= session.attached_tokens or start_pos < 1:
            return False
        self.lengths.cut(session.cache, layers, start_pos)
        session.attached_tokens = start_pos
        return True
