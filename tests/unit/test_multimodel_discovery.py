"""`llm.models` on a mesh serving several models, schemes and checkpoints: a model is listed by the weights this
orchestrator routes it with (its head's), so a checkpoint of the same name with other weights (another seed) can
neither make it look served nor hide the schemes it is served in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.readmodels.queries import ShardCandidate
from hearth.services.orchestrator.discovery import describe_models

OURS, OTHER_SEED = "aa" * 32, "ff" * 32


def shard(model_id: str, lo: int, hi: int, node: str, *, weights: str = OURS, scheme: str = "none",
          total: int = 6) -> ShardCandidate:
    return ShardCandidate(shard_id=f"{model_id}:{lo}-{hi}@{node}", model_id=model_id, weights_sha256=weights,
                          node_id=node, layer_lo=lo, layer_hi=hi, total_layers=total, control_subject="c",
                          hop_weight=1.0, max_concurrent_streams=1, status="advertised", advertised_at=0,
                          expires_at=10, last_seen=None, queue_depth=None, active_streams=None, quantization=scheme)


def models_listed(shards: list[ShardCandidate], loaded: dict[str, tuple[str, int]]) -> dict:
    """What describe_models answers over `shards`, for an orchestrator holding the heads `loaded` (model id ->
    weights, layers)."""
    router = SimpleNamespace(all_candidates=lambda: shards, now=lambda: 0.0, alive=lambda shard, now: True)
    catalog = SimpleNamespace(
        local_model_at_hand=lambda: None, path_of_id=lambda model_id, local: None,
        loaded_of_id=lambda model_id: (SimpleNamespace(weights_sha256=loaded[model_id][0],
                                                       head=SimpleNamespace(info=SimpleNamespace(
                                                           num_layers=loaded[model_id][1])))
                                       if model_id in loaded else None))
    reply = asyncio.run(describe_models(router, catalog))
    return {model.id: model for model in reply.models} | {"default": reply.default_model}


def test_another_seed_under_the_same_name_neither_hides_our_schemes_nor_names_its_weights():
    # Ours: whole in none and int8; another seed's whole-model shard under the same name (its digest sorts last).
    listed = models_listed([shard("llama", 0, 5, "a"), shard("llama", 0, 5, "b", scheme="int8"),
                            shard("llama", 0, 5, "e", weights=OTHER_SEED)], {"llama": (OURS, 6)})
    assert listed["llama"].complete and listed["llama"].weights_sha256 == OURS
    assert listed["llama"].quantizations == ["none", "int8"]


def test_a_model_whole_only_in_other_weights_is_not_listed_as_servable():
    # Our weights leave layers 3-5 uncovered: routing would answer weights_mismatch, so the model is not complete.
    listed = models_listed([shard("llama", 0, 2, "a"), shard("llama", 0, 5, "e", weights=OTHER_SEED),
                            shard("qwen", 0, 5, "c")], {"llama": (OURS, 6), "qwen": (OURS, 6)})
    assert not listed["llama"].complete and listed["llama"].quantizations == []
    assert listed["llama"].covered_layers == [(0, 2)] and listed["llama"].weights_sha256 == OURS
    assert listed["qwen"].complete and listed["default"] == "qwen"


def test_a_shard_advertising_another_layer_count_does_not_count():
    # Routing leaves out a shard whose layer count is not the model's as the orchestrator loaded it.
    listed = models_listed([shard("llama", 0, 2, "a"), shard("llama", 3, 7, "b", total=8)], {"llama": (OURS, 6)})
    assert not listed["llama"].complete and listed["llama"].total_layers == 6


def test_without_a_head_here_the_weights_covering_most_are_listed():
    listed = models_listed([shard("llama", 0, 2, "a"), shard("llama", 0, 5, "e", weights=OTHER_SEED)], {})
    assert listed["llama"].complete and listed["llama"].weights_sha256 == OTHER_SEED
