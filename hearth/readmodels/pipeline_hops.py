"""A pipeline's chain of hops after a failover, from the failed shard and the `replacement_hops` of the event."""

from __future__ import annotations

from hearth.protocol.subjects import parse_shard_id


def hops_after_failover(
    current_hops: list[str], failed_shard_id: str, replacement_hops: list[str]
) -> list[str]:
    """The pipeline's hops after a failover.

    Producers use `replacement_hops` in two ways: docs/events.md's example lists only the shards taking over
    the failed shard's layers (hops [A 0-11, B 12-23], B fails, replacement [C 12-23] -> [A, C]), while an
    orchestrator that repicks the whole chain lists every new hop. It is read as the whole new chain when
    it repeats a surviving hop, when nothing survives, or when its layers (read from the shard ids: parse_shard_id)
    reach from the chain's first layer to its last; otherwise it is spliced in at the failed shard's place.
    """
    surviving = [shard_id for shard_id in current_hops if shard_id != failed_shard_id]
    if failed_shard_id not in current_hops or not surviving or set(replacement_hops) & set(surviving):
        return list(replacement_hops)
    chain_span, replacement_span = _layer_span(current_hops), _layer_span(replacement_hops)
    if chain_span is not None and replacement_span is not None:
        if replacement_span[0] <= chain_span[0] and replacement_span[1] >= chain_span[1]:
            return list(replacement_hops)
    index = current_hops.index(failed_shard_id)
    return current_hops[:index] + list(replacement_hops) + current_hops[index + 1:]


def _layer_span(shard_ids: list[str]) -> tuple[int, int] | None:
    """(lowest lo, highest hi) of the layer ranges named in the shard ids; None if one does not parse."""
    ranges = []
    for shard_id in shard_ids:
        parts = parse_shard_id(shard_id)
        if parts is None:
            return None
        ranges.append((parts.layer_lo, parts.layer_hi))
    if not ranges:
        return None
    return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
