"""ChainPlacement: where a chain's hops sit in the pipeline their hosts are told about."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hearth.protocol.subjects import node_token
from hearth.services.orchestrator.router import Hop


@dataclass(frozen=True)
class ChainPlacement:
    """Where a chain's hops sit in the pipeline its hosts see: the first one's index, how many hops the pipeline
    has, and the nodes before the first and after the last (None: this orchestrator, as in a whole pipeline)."""

    first_hop: int = 0
    hop_count: int | None = None
    upstream_node: str | None = None
    downstream_node: str | None = None

    @classmethod
    def of_hop(cls, hops: Sequence[Hop], index: int) -> "ChainPlacement":
        """Where hop `index` of a chain over `hops` sits, for a session of one hop that is to look like it."""
        return cls(first_hop=index, hop_count=len(hops),
                   upstream_node=hops[index - 1].node_id if index > 0 else None,
                   downstream_node=hops[index + 1].node_id if index + 1 < len(hops) else None)

    def seen_by(self, hops: Sequence[Hop], index: int, own_node: str) -> dict:
        """What the host of hop `index` of a chain over `hops` (opened by `own_node`) is told of its place: its hop
        number, the pipeline's hop count, and the nodes it receives from and sends to (OpenHop's fields)."""
        return {"hop": self.first_hop + index, "hop_count": self.hop_count or len(hops),
                "upstream_node": node_token(hops[index - 1].node_id if index > 0 else self.upstream_node or own_node),
                "downstream_node": node_token(hops[index + 1].node_id if index + 1 < len(hops)
                                              else self.downstream_node or own_node)}
