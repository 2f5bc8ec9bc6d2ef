"""Model discovery (`llm.models`): which models the mesh can serve now, read from the routing read model, and
the default model a request without `model` gets.

A model counts as servable when live shards with one set of weights and one quantization scheme cover every
layer (`complete`; `quantizations` lists each scheme that does), or when
this orchestrator can run it whole by itself (`runnable_locally`, the local fallback). The default model is
the servable one when there is exactly one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from hearth.readmodels.queries import ShardCandidate
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.quantization_labels import precision_order
from hearth.services.orchestrator.catalog import ModelCatalog, context_length
from hearth.services.orchestrator.router import ShardRouter

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


def served_model(model_id: str, shards: list[ShardCandidate], *, weights_sha256: str | None = None,
                 total_layers: int | None = None) -> ServedModel:
    """The coverage of one model by its live shards: of the weights and quantization scheme that cover most
    layers (the most precise scheme of equals), with every scheme those weights cover completely.
    `weights_sha256`, `total_layers`: the model as this orchestrator loaded it (its head), when it has: only shards
    of those weights and that layer count count, as only they can be routed (router.py), so a checkpoint of the
    same name with other weights (another seed) neither makes the model look servable nor hides a scheme of ours;
    None: the weights that cover most, of the largest layer count advertised."""
    shards = [s for s in shards if weights_sha256 in (None, s.weights_sha256)
              and total_layers in (None, s.total_layers)]
    if not shards:
        return ServedModel(id=model_id, total_layers=total_layers or 0, complete=False, weights_sha256=weights_sha256)
    groups: dict[tuple[str, str], list[ShardCandidate]] = defaultdict(list)
    for shard in shards:
        groups[(shard.weights_sha256, shard.quantization)].append(shard)
    total_layers = total_layers or max(s.total_layers for s in shards)
    coverage = {key: covered_ranges(group, total_layers) for key, group in groups.items()}
    (weights, _), ranges = max(coverage.items(), key=lambda item: (
        _covered_count(item[1]), [-rank for rank in precision_order(item[0][1])[:2]], item[0][0]))
    complete = sorted((scheme for (digest, scheme), covered in coverage.items()
                       if digest == weights and _covered_count(covered) == total_layers), key=precision_order)
    return ServedModel(id=model_id, total_layers=total_layers, covered_layers=ranges, weights_sha256=weights,
                       complete=_covered_count(ranges) == total_layers, quantizations=complete)


def is_advertised(router: ShardRouter, model_id: str) -> bool:
    """Whether a live shard advertises `model_id` (one read of the routing read model: blocking)."""
    now = router.now()
    return any(router.alive(shard, now) for shard in router.candidates(model_id))


async def describe_models(router: ShardRouter, catalog: ModelCatalog) -> ModelsReply:
    """What `llm.models` answers now."""
    rows = await asyncio.to_thread(router.all_candidates)
    now = router.now()
    live: dict[str, list[ShardCandidate]] = defaultdict(list)
    for shard in rows:
        if router.alive(shard, now):
            live[shard.model_id].append(shard)
    models = {}
    for model_id, shards in live.items():
        # Judged by the weights this orchestrator routes the model with, where it holds its head (ModelCatalog.get).
        loaded = catalog.loaded_of_id(model_id)
        models[model_id] = served_model(
            model_id, shards, weights_sha256=loaded.weights_sha256 if loaded is not None else None,
            total_layers=loaded.head.info.num_layers if loaded is not None else None)
    # Found once for the whole answer (every id below is matched against it): it may read config and headers from disk.
    local = await asyncio.to_thread(catalog.local_model_at_hand)
    if local is not None:
        entry = models.get(local.model_id) or ServedModel(id=local.model_id, total_layers=0, complete=False)
        models[local.model_id] = entry.model_copy(update={"runnable_locally": True})
    described = []
    for model_id in sorted(models):
        length = None
        # Advertised ids come from other members: looked up in the catalog only, never opened as paths.
        path = await asyncio.to_thread(catalog.path_of_id, model_id, local)
        if path is not None:
            length = await asyncio.to_thread(context_length, path)
        else:
            log.debug("model %s is not on this orchestrator's disk; its context length is unknown", model_id)
        described.append(models[model_id].model_copy(update={"context_length": length}))
    servable = [m.id for m in described if m.complete or m.runnable_locally]
    return ModelsReply(models=described, default_model=servable[0] if len(servable) == 1 else None,
                       orchestrator_time_s=time.time())
