"""Naming a call's blocks (hearth/services/orchestrator/prefix.py) and routing a call to the chain that kept them
(hearth/services/orchestrator/affinity.py): names chain over every token before and over the caller, public system
prompts are shared, an edit changes every later name, and the kept chain wins only when what it saves outweighs its
cost."""

from __future__ import annotations

from hearth.services.common.config_processes import PrefixCacheSettings
from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator.affinity import prefer_kept
from hearth.services.orchestrator.prefix import CallPrefix, KeptChains, block_names, first_name, public_blocks_of
from hearth.services.orchestrator.router import Hop

FIRST = first_name("tiny", "abc", "none", "auto", 4)
IDS = list(range(100, 118))  # 18 tokens: four whole blocks of 4


def naming(scope: str = "member:ann", public_blocks: int = 0, reuse_allowed: bool = True) -> CallPrefix:
    return CallPrefix(PrefixCacheSettings(block_tokens=4), FIRST, scope, public_blocks, reuse_allowed)


def test_a_name_stands_for_every_token_before_it_and_for_the_caller():
    names = block_names(IDS, 4, FIRST, "member:ann")
    assert len(names) == 4 and len(set(names)) == 4
    edited = block_names([IDS[0], 999, *IDS[2:]], 4, FIRST, "member:ann")
    assert all(a != b for a, b in zip(names, edited))  # the first block changed, so every later name does
    tail_edited = block_names([*IDS[:12], 999, *IDS[13:]], 4, FIRST, "member:ann")
    assert tail_edited[:3] == names[:3] and tail_edited[3] != names[3]
    assert block_names(IDS, 4, FIRST, "member:bob")[0] != names[0]
    # Another scheme, model or checkpoint (another seed under the same name): no block of one serves the other.
    for other in (first_name("tiny", "abc", "int8", "auto", 4), first_name("tiny-qwen", "abc", "none", "auto", 4),
                  first_name("tiny", "abd", "none", "auto", 4)):
        assert block_names(IDS, 4, other, "member:ann")[0] != names[0]
    # A LongRoPE model's prompts rotate on its short or long factors by their length: neither set's KV serves the other.
    short, long = (block_names(IDS, 4, first_name("tiny", "abc", "none", "auto", 4, factors), "member:ann")[0]
                   for factors in ("short", "long"))
    assert len({short, long, names[0]}) == 3


def test_blocks_inside_a_public_prompt_are_shared_and_the_rest_stays_the_caller_s():
    ann = block_names(IDS, 4, FIRST, "member:ann", public_blocks=2)
    bob = block_names(IDS, 4, FIRST, "member:bob", public_blocks=2)
    assert ann[:2] == bob[:2] and ann[2] != bob[2]
    assert public_blocks_of(IDS, [IDS[:9], [1, 2]], 4) == 2
    assert public_blocks_of(IDS, [[7, 8, 9, 10, 11]], 4) == 0


def test_a_call_reuses_blocks_before_its_last_token_and_keeps_what_it_ran():
    # 17 known tokens: the last must be computed, so 4 blocks (16 tokens) may come from kept KV.
    assert len(naming().reusable(IDS[:17]).hashes) == 4
    assert len(naming().reusable(IDS[:16]).hashes) == 3
    assert naming().reusable(IDS[:4]) is None
    assert naming(reuse_allowed=False).reusable(IDS) is None  # verify all / vote: every position is computed
    assert naming().kept(IDS[:15]).hashes == naming().reusable(IDS[:13]).hashes


def test_the_chain_that_kept_most_blocks_is_remembered():
    chains = KeptChains(capacity=6)
    names = block_names(IDS, 4, FIRST, "member:ann")
    chains.remember(names[:2], [("a", 0, 5)])
    chains.remember(names, [("b", 0, 5)])
    assert chains.holding(names[:3]).hops == (("b", 0, 5),) and chains.holding(names[:3]).blocks == 3
    chains.remember(block_names(IDS, 4, FIRST, "member:bob"), [("c", 0, 5)])
    assert chains.holding(names[:2]) is None  # the oldest names made room
    assert chains.holding(names).blocks == 4


def candidate(shard_id: str, step_ms: float) -> ShardCandidate:
    return ShardCandidate(shard_id=shard_id, model_id="tiny", weights_sha256="abc", node_id=shard_id, layer_lo=0,
                          layer_hi=5, total_layers=6, control_subject=f"ctl.{shard_id}", hop_weight=1.0,
                          max_concurrent_streams=4, status="advertised", advertised_at=0, expires_at=10**10,
                          last_seen=0, queue_depth=0, active_streams=0, decode_step_ms=step_ms)


def hop(shard_id: str) -> Hop:
    return Hop(shard_id=shard_id, control_subject=f"ctl.{shard_id}", node_id=shard_id, layer_lo_to_run=0,
               layer_hi_to_run=5)


def test_the_kept_chain_wins_when_the_prefill_it_saves_outweighs_its_cost():
    kept = KeptChains()
    kept.remember(["n0", "n1", "n2", "n3"], [("slow", 0, 5)])
    holding = kept.holding(["n0", "n1", "n2", "n3"])
    usable = {"fast": candidate("fast", 10.0), "slow": candidate("slow", 12.0)}
    options = dict(load=None, block_tokens=256, max_tokens=40, prefill_token_cost=0.25)
    # 1 025 prompt positions, 1 024 of them kept on `slow`: 20 % slower per token is worth it.
    chosen, blocks = prefer_kept([hop("fast")], holding, usable, prompt_positions=1025, **options)
    assert [h.shard_id for h in chosen] == ["slow"] and blocks == 4
    # Twice as slow, and only a short prompt to save: the cheapest chain stays.
    usable["slow"] = candidate("slow", 20.0)
    short = KeptChains()
    short.remember(["n0"], [("slow", 0, 5)])
    chosen, blocks = prefer_kept([hop("fast")], short.holding(["n0"]), usable, prompt_positions=20,
                                 **options | {"block_tokens": 8})
    assert [h.shard_id for h in chosen] == ["fast"] and blocks == 0
    # A kept chain with a shard that may not serve now is no option.
    del usable["slow"]
    assert prefer_kept([hop("fast")], holding, usable, prompt_positions=1025, **options)[0][0].shard_id == "fast"
