"""Model discovery (`llm.models`): which models the mesh can serve now, read from the routing read model, and
the default model a request without `model` gets.

A model counts as servable when live shards with one set of weights cover every layer (`complete`), or when
this orchestrator can run it whole by itself (`runnable_locally`, the local fallback). The default model is
the servable one when there is exactly one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from readmodels.queries import ShardCandidate
from services.common.chat_protocol import ModelsReply, ServedModel
from services.orchestrator.catalog import ModelCatalog, context_length
from services.orchestrator.router import ShardRouter

log = logging.getLogger(__name__)


def covered_ranges(shards: list[ShardCandidate], total_layers: int) -> list[tuple[int, int]]:
    """The inclusive layer ranges the shards cover together, merged and sorted."""
    merged: list[list[int]] = []
    for lo, hi in sorted((s.layer_lo, min(s.layer_hi, total_layers - 1)) for s in shards):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _covered_count(ranges: list[tuple[int, int]]) -> int:
    return sum(hi - lo + 1 for lo, hi in ranges)


def served_model(model_id: str, shards: list[ShardCandidate]) -> ServedModel:
    """The coverage of one model by its live shards: of the weights that cover most layers."""
    by_weights: dict[str, list[ShardCandidate]] = defaultdict(list)
    for shard in shards:
        by_weights[shard.weights_sha256].append(shard)
    total_layers = max(s.total_layers for s in shards)
    weights, ranges = max(((w, covered_ranges(group, total_layers)) for w, group in by_weights.items()),
                          key=lambda item: (_covered_count(item[1]), item[0]))
    return ServedModel(id=model_id, total_layers=total_layers, covered_layers=ranges, weights_sha256=weights,
                       complete=_covered_count(ranges) == total_layers)


async def describe_models(router: ShardRouter, catalog: ModelCatalog) -> ModelsReply:
    """What `llm.models` answers now."""
    rows = await asyncio.to_thread(router.all_candidates)
    now = router.now()
    live: dict[str, list[ShardCandidate]] = defaultdict(list)
    for shard in rows:
        if router.alive(shard, now):
            live[shard.model_id].append(shard)
    models = {model_id: served_model(model_id, shards) for model_id, shards in live.items()}
    local_id = catalog.local_model_id()
    if local_id is not None:
        entry = models.get(local_id) or ServedModel(id=local_id, total_layers=0, complete=False)
        models[local_id] = entry.model_copy(update={"runnable_locally": True})
    described = []
    for model_id in sorted(models):
        length = None
        # Advertised ids come from other members: looked up in the catalog only, never opened as paths.
        path = await asyncio.to_thread(catalog.path_of_id, model_id)
        if path is not None:
            length = await asyncio.to_thread(context_length, path / "config.json")
        else:
            log.debug("model %s is not on this orchestrator's disk; its context length is unknown", model_id)
        described.append(models[model_id].model_copy(update={"context_length": length}))
    servable = [m.id for m in described if m.complete or m.runnable_locally]
    return ModelsReply(models=described, default_model=servable[0] if len(servable) == 1 else None)
