"""What a quarantine holds: a confirmed mismatch quarantines a shard id, and that holds its whole node (every shard
of it, any model, range or scheme), so a host caught lying cannot come back under a new shard id; and the one
wording that says so wherever a held shard is shown (routing failures, `hearth-replay shard`, `hearth community`,
`hearth status` and the dashboards' SQL, hearth/services/dashboards/panels.py); and how far one reporter's word
reaches: a member's checks hold at most MAX_NODES_HELD_PER_REPORTER nodes at once, so one orchestrator that lies in
its accusations cannot take the mesh down before a steward reads them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hearth.protocol.subjects import node_of_shard

# The most nodes one reporter's confirmed mismatches hold quarantined at once (hearth/readmodels/reputation.py): an
# accusation is the reporter's word (nothing in the log proves the accused's output was wrong), so past this bound
# its further accusations are kept as evidence (kind "unheld") for a steward, and quarantine nobody. An honest
# orchestrator that caught more liars still routes around them itself (RunContext.quarantined).
MAX_NODES_HELD_PER_REPORTER = 2


def quarantined_nodes(quarantined_shard_ids: Iterable[str]) -> dict[str, str]:
    """node -> the first (by id) of `quarantined_shard_ids` on it: the nodes a quarantine holds."""
    nodes: dict[str, str] = {}
    for shard_id in sorted(quarantined_shard_ids):
        node = node_of_shard(shard_id)
        if node is not None:
            nodes.setdefault(node, shard_id)
    return nodes


@dataclass(frozen=True)
class Held:
    """What a set of quarantined shard ids holds out: those shards, and every shard of their nodes. The one form in
    which the orchestrator's own proofs are applied (routing, mirrors, canaries, running calls); the read model's
    quarantines reach routing through queries.py, in SQL."""

    shard_ids: frozenset[str]
    nodes: dict[str, str]  # node -> the first (by id) of shard_ids on it

    @classmethod
    def of(cls, quarantined_shard_ids: Iterable[str]) -> Held:
        shard_ids = frozenset(quarantined_shard_ids)
        return cls(shard_ids, quarantined_nodes(shard_ids))

    def holds(self, shard_id: str, node_id: str | None) -> bool:
        """Whether the shard `shard_id` of `node_id` is held out: quarantined itself, or its node is."""
        return shard_id in self.shard_ids or node_id in self.nodes

    def node_reason(self, node_id: str) -> str:
        """Why a shard of a held node is left out (node_quarantine_reason)."""
        return node_quarantine_reason(node_id, self.nodes[node_id])


def node_quarantine_reason(node_id: str, quarantined_shard_id: str) -> str:
    """Why a shard of `node_id` is left out while another shard of it, `quarantined_shard_id`, is quarantined."""
    return f"node {node_id} quarantined (shard {quarantined_shard_id} mismatched)"


def held_node(shard_id: str) -> str:
    """The node a quarantine of `shard_id` holds (the shard id itself when it names no node)."""
    return node_of_shard(shard_id) or shard_id


def unheld_reason(reporter: str, held: Iterable[str]) -> str:
    """Why a confirmed mismatch reported by `reporter` quarantined nobody: its checks already hold `held`."""
    nodes = sorted(held)
    return (f"not quarantined: {reporter}'s checks already hold {len(nodes)} nodes quarantined ({', '.join(nodes)}), "
            f"the most one reporter's hold at once; a steward reads the evidence")
