"""What a quarantine holds: a confirmed mismatch quarantines a shard id, and that holds its whole node (every shard
of it, any model, range or scheme), so a host caught lying cannot come back under a new shard id; and the one
wording that says so wherever a held shard is shown (routing failures, `hearth-replay shard`, `hearth community`,
`hearth status` and the dashboards' SQL, hearth/services/dashboards/panels.py)."""

from __future__ import annotations

from collections.abc import Iterable

from hearth.protocol.subjects import node_of_shard


def quarantined_nodes(quarantined_shard_ids: Iterable[str]) -> dict[str, str]:
    """node -> the first (by id) of `quarantined_shard_ids` on it: the nodes a quarantine holds."""
    nodes: dict[str, str] = {}
    for shard_id in sorted(quarantined_shard_ids):
        node = node_of_shard(shard_id)
        if node is not None:
            nodes.setdefault(node, shard_id)
    return nodes


def node_quarantine_reason(node_id: str, quarantined_shard_id: str) -> str:
    """Why a shard of `node_id` is left out while another shard of it, `quarantined_shard_id`, is quarantined."""
    return f"node {node_id} quarantined (shard {quarantined_shard_id} mismatched)"
