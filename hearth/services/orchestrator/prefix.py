"""Kept prefixes, the orchestrator's side: the chained names of a call's whole token blocks (what shards keep and
find their KV by), whose blocks may be shared, which of this orchestrator's chains kept which (for routing) and
which names a completed call records for every orchestrator's read model.

A block's name is a 128-bit BLAKE2b digest over the name of the block before it (the first over the model id, its
weights' digest, the scheme, the wire dtype and the block size), the block's scope and its token ids, so one name
stands for every token before it and for what computed them: equal names, equal KV (up to float rounding). The scope
is the caller (a roster member; every unsigned caller together) unless the block's tokens are those of a system prompt
listed in `[prefix_cache] public_system_prompts` rendered alone: no member's call can find another member's blocks,
so nothing about another member's conversation leaks through time to first token. A hop after the first keeps and
finds the names bound to the hops before it (`behind_hops`), so kept KV is attached only behind the hosts that fed it.
On a community mesh the names are keyed by a secret of the calling orchestrators' member (`first_name`): the hosts
of a call's later hops see its names but not its tokens, and must not be able to test a guess at them.

A block's name opens its KV on the shards that keep it, so it travels only to the hops of the calls that computed or
reuse it, never into the event log: a completed call records each kept block by its mark (`published_mark`, a digest
of the name), which routing can look a call's own names up by but no member can turn back into a name to attach.

A name alone does not open KV kept by another member's hops: on a community mesh a shard finds kept blocks only for
hops opened (signed) by the member whose hops kept them (hearth/inference/prefix_cache.py, `prefix_keys`), since an
orchestrator that can guess a call's tokens can compute its names and keep junk under them, and a shard never sees
tokens to tell. A public system prompt's blocks are so shared by the callers of one member's orchestrators, each
member prefilling them once per shard. A mark is likewise drawn per member (its orchestrators' key): routing finds
only chains whose blocks its own hops may attach, and reads only records its member signed (a copy of the mark in
another member's event is that member's record: hearth/readmodels/kept_prefixes.py).

A call reuses a prefix only for its chain's first prefill, and never at `verify` levels `all` and `vote` (they
check every position, and a mirror would need the positions the call did not compute). Blocks are kept when a call
ends well: its prompt's whole blocks at its close, then its answer's once a warm-up prefilled them (a decode step's KV
is not a prefill's: hearth/services/orchestrator/answer_kv.py).
"""

from __future__ import annotations

import functools
import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hearth.protocol.control import PrefixBlocks, max_prefix_blocks
from hearth.readmodels.queries import KeptChain
from hearth.services.common.config_processes import PrefixCacheSettings
from hearth.services.orchestrator.kept_expiry import IdleExpiry, pop_expired
from hearth.services.orchestrator.router import Hop
from hearth.trust.keys import MemberKey

PUBLIC_SCOPE = "public"
# Block names remembered for routing, with the chain that kept each.
remembered_names = 65536


def first_name(model_id: str, weights_sha256: str, quantization: str, wire_dtype: str, block_tokens: int,
               rotary_factors: str = "", keeper: MemberKey | None = None) -> bytes:
    """What the first block's name is chained onto: everything besides the tokens that shapes their KV (with
    `rotary_factors`, which of its factor sets a model whose RoPE picks them by the prompt's length rotates it on),
    keyed by a secret of `keeper`, the member whose orchestrators name the call's blocks (None on an open mesh).
    Every name chains onto this one, and all else a name is drawn over is known to every member: unkeyed, a later
    hop's host, which sees the names but not the tokens, could confirm a guess at a conversation by computing them.
    Only hops opened by that member find the blocks anyway (`prefix_keys`), so the key costs no sharing."""
    identity = "\0".join(["hearth-prefix-1", model_id, weights_sha256, quantization, wire_dtype, str(block_tokens),
                          *([rotary_factors] if rotary_factors else [])])
    key = b"" if keeper is None else _member_secret(keeper.seed, b"hearth-kept-name")
    return hashlib.blake2b(identity.encode(), digest_size=16, key=key).digest()


def block_names(ids: Sequence[int], block_tokens: int, first: bytes, scope: str, public_blocks: int = 0) -> list[str]:
    """The names of the whole blocks of `ids` (the first `public_blocks` in the public scope, the rest in `scope`)."""
    names, previous = [], first
    for index in range(min(len(ids) // block_tokens, max_prefix_blocks)):
        block = ids[index * block_tokens:(index + 1) * block_tokens]
        block_scope = PUBLIC_SCOPE if index < public_blocks else scope
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(block_scope.encode() + b"\0")
        digest.update(struct.pack(f"<{len(block)}q", *block))
        previous = digest.digest()
        names.append(previous.hex())
    return names


def behind_hops(blocks: PrefixBlocks | None, hops: Sequence[Hop], index: int) -> PrefixBlocks | None:
    """The names hop `index` of a chain over `hops` keeps and attaches `blocks` under: the call's own for the first hop,
    and for a later one bound to the hops before it (their shard ids and layers), so KV a hop kept is attached again
    only behind the very hosts whose activations computed it. Behind other hosts a hop finds nothing and the chain
    prefills (a replica's activations differ in their last bits, and a host proved wrong since must not go on
    feeding later turns through the KV it fed: hearth/services/orchestrator/verification.py)."""
    if blocks is None or index == 0:
        return blocks
    upstream = hashlib.blake2b(digest_size=16, person=b"hearth-behind")
    for hop in hops[:index]:
        upstream.update(f"{hop.shard_id}\0{hop.layer_lo_to_run}\0{hop.layer_hi_to_run}\0".encode())
    lineage = upstream.digest()
    return PrefixBlocks(block_tokens=blocks.block_tokens, hashes=[
        hashlib.blake2b(bytes.fromhex(name), digest_size=16, key=lineage).hexdigest() for name in blocks.hashes])


def caller_scope(caller: str | None) -> str:
    return f"member:{caller}" if caller else "unsigned"


@dataclass(frozen=True)
class CallPrefix:
    """One call's naming of its blocks (built per chain: the scheme is known once routed)."""

    settings: PrefixCacheSettings
    first: bytes
    scope: str
    public_blocks: int
    reuse_allowed: bool

    def reusable(self, known_ids: Sequence[int]) -> PrefixBlocks | None:
        """The blocks a chain's first prefill may take from kept prefixes: whole blocks before the last known token
        (whose output the next token needs)."""
        if not self.reuse_allowed or len(known_ids) <= self.settings.block_tokens:
            return None
        return self._blocks(known_ids[:len(known_ids) - 1])

    def kept(self, fed_ids: Sequence[int]) -> PrefixBlocks | None:
        """The blocks of the positions a chain ran, for its hops to keep."""
        if len(fed_ids) < self.settings.block_tokens:
            return None
        return self._blocks(fed_ids)

    def _blocks(self, ids: Sequence[int]) -> PrefixBlocks:
        bs = self.settings.block_tokens
        return PrefixBlocks(block_tokens=bs, hashes=block_names(ids, bs, self.first, self.scope, self.public_blocks))


def public_blocks_of(prompt_ids: Sequence[int], public_prompt_ids: Sequence[Sequence[int]], block_tokens: int) -> int:
    """How many whole blocks of a prompt are tokens of a public system prompt's own rendering (their longest common
    beginning: a template may end the system turn alone differently, e.g. with an end-of-text token)."""
    longest = 0
    for ids in public_prompt_ids:
        common = 0
        for ours, public in zip(prompt_ids, ids):
            if ours != public:
                break
            common += 1
        longest = max(longest, common)
    return longest // block_tokens


def published_mark(name: str, keeper: MemberKey | None) -> str:
    """What the event log records for the kept block `name` that hops of `keeper` keep (the key of the member whose
    orchestrators opened them; None on an open mesh): a digest that finds the chain keeping it for that member's
    orchestrators only (another member's hops could not attach it), never the name itself, which would let any member
    reading the log attach that KV (or keep its own under it). Keyed by a secret drawn from the member's seed: all
    else a name is drawn over is known to every member (model, scheme, the caller's roster name), so an unkeyed mark
    would let any of them confirm a guessed conversation of another's against the log."""
    if keeper is None:
        return hashlib.blake2b(b"hearth-kept-mark\0" + bytes.fromhex(name), digest_size=16).hexdigest()
    return hashlib.blake2b(bytes.fromhex(name), digest_size=16,
                           key=_member_secret(keeper.seed, b"hearth-kept-mark")).hexdigest()


@functools.lru_cache(maxsize=8)
def _member_secret(seed: bytes, purpose: bytes) -> bytes:
    """A key drawn from a member's seed for one `purpose` (once per seed: a call's lookup draws up to
    `max_prefix_blocks` marks)."""
    return hashlib.blake2b(seed, digest_size=32, person=purpose).digest()


def kept_marks(names: Sequence[str], prompt_blocks: int, keeper: MemberKey | None) -> list[tuple[int, str]]:
    """Which of a call's kept blocks its `pipeline.completed` records, as (blocks closed, published mark of `keeper`):
    the last, the last two wholly inside the prompt (a next turn resends the prompt as it was, while the answer may
    tokenize differently where it meets what follows) and the 1st, 2nd, 4th, ... (an edited history still finds
    some)."""
    counts = {len(names), prompt_blocks, prompt_blocks - 1}
    power = 1
    while power < len(names):
        counts.add(power)
        power *= 2
    return [(blocks, published_mark(names[blocks - 1], keeper)) for blocks in sorted(counts)
            if 1 <= blocks <= len(names)]


class KeptChains:
    """Which chains of this orchestrator kept which blocks (every block's name, least recently kept first); what
    routing consults to send a conversation's next turn where its prefix is. A name goes beyond `capacity`, or once
    not kept again for the shards' idle time (`idle_s`, `[shard] prefix_cache_idle_s`; None: only beyond capacity),
    when its hops have dropped the block (kept_expiry.py)."""

    def __init__(self, capacity: int = remembered_names, *, idle_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self._expiry = IdleExpiry(idle_s, clock)
        # Name -> (the chain's hops, blocks up to it, when kept).
        self._by_name: OrderedDict[str, tuple[tuple[tuple[str, int, int], ...], int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_name)

    def remember(self, names: Sequence[str], hops: Sequence[tuple[str, int, int]]) -> None:
        self.drop_expired()
        chain, now_s = tuple(hops), self._expiry.clock()
        for blocks, name in enumerate(names, start=1):
            self._by_name[name] = (chain, blocks, now_s)
            self._by_name.move_to_end(name)
        while len(self._by_name) > self.capacity:
            self._by_name.popitem(last=False)

    def holding(self, names: Sequence[str]) -> KeptChain | None:
        """The chain that kept the most leading blocks of `names` (how many: `blocks` of the answer)."""
        self.drop_expired()
        for blocks in range(len(names), 0, -1):
            kept = self._by_name.get(names[blocks - 1])
            if kept is not None:
                return KeptChain(kept[0], blocks)
        return None

    def drop_expired(self, limit: int | None = None) -> int:
        """Forget the names not kept again for the shards' idle time (at most `limit`); how many."""
        return len(pop_expired(self._by_name, lambda kept: kept[2], self._expiry, limit))
