"""Read-only queries over the read models that services need (routing candidates, kept prefixes, reputation,
positions), and how a model's layer coverage reads (`hearth status`, `hearth host`'s log)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from sqlalchemy import func, select
from sqlalchemy.orm import Session, aliased

from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.readmodels.kept_prefixes import records_signer
from hearth.readmodels.projection import PROJECTION_NAME, load_positions
from hearth.readmodels.reputation import QUARANTINED
from hearth.readmodels.tables import KeptPrefixRecord, Shard, ShardHealth, ShardReputation

# Block names looked up per statement: below the smallest limit SQLite builds put on bound parameters (999).
kept_names_per_lookup = 500


@dataclass(frozen=True)
class ShardCandidate:
    """One advertised shard of a model with its latest heartbeat (None fields when it never sent one)."""

    shard_id: str
    model_id: str
    weights_sha256: str
    node_id: str
    layer_lo: int
    layer_hi: int
    total_layers: int
    control_subject: str
    hop_weight: float
    max_concurrent_streams: int
    status: str
    advertised_at: int
    expires_at: int
    last_seen: int | None
    queue_depth: int | None
    active_streams: int | None
    decode_step_ms: float | None = None
    # The weight quantization scheme it serves ("none", "int8", "int4/g64"); a pipeline never mixes them.
    quantization: str = "none"
    # The mesh protocol it speaks (hearth/protocol/mesh_protocol.py; None: a hearth from before protocol versions).
    protocol: int | None = MESH_PROTOCOL
    # A confirmed mismatch was blamed on it and no steward has cleared it since: never routed.
    quarantined: bool = False
    # Another shard of its node that is quarantined (None: none is): a quarantine holds the node, so this one is not
    # routed either, whatever its range or scheme (a new shard id is no way out of a quarantine).
    node_quarantined_by: str | None = None
    # The dtype it computes in: two replicas' outputs are compared within that dtype's honest tolerance.
    dtype: str = "float32"
    # When (epoch s) and why it was withdrawn, if it was: "moved" is a `hearth host` moving to another range.
    withdrawn_at: int | None = None
    withdrawn_reason: str | None = None
    # Its latest heartbeat's date less when the broker stored it, in s (None: no heartbeat, or one from before 0023).
    clock_skew_s: int | None = None


def shards_of_model(session: Session, model_id: str) -> list[ShardCandidate]:
    """Every shard advertised for `model_id` (withdrawn and expired ones included, until the retention prunes
    them: readmodels.retention), with its health."""
    return _shards(session, Shard.model_id == model_id)


def all_shards(session: Session) -> list[ShardCandidate]:
    """Every shard advertised, of every model (withdrawn and expired ones included, until the retention prunes
    them), with its health."""
    return _shards(session, None)


def newest_sign_of_life(session: Session) -> int | None:
    """Epoch s of the newest advertisement or heartbeat of any shard the read model holds (None: none yet): how far
    the heartbeats' stream has reached this read model, whatever the wall clock says."""
    heard = session.execute(select(func.max(ShardHealth.last_seen))).scalar()
    advertised = session.execute(select(func.max(Shard.advertised_at))).scalar()
    known = [instant for instant in (heard, advertised) if instant is not None]
    return max(known) if known else None


def _shards(session: Session, condition) -> list[ShardCandidate]:
    sibling = aliased(ShardReputation)
    node_quarantined_by = (
        select(func.min(sibling.shard_id))
        .where(sibling.status == QUARANTINED, sibling.node_id == Shard.node_id, sibling.shard_id != Shard.shard_id)
        .scalar_subquery()
    )
    query = (
        select(
            Shard.shard_id,
            Shard.model_id,
            Shard.weights_sha256,
            Shard.node_id,
            Shard.layer_lo,
            Shard.layer_hi,
            Shard.total_layers,
            Shard.control_subject,
            Shard.hop_weight,
            Shard.max_concurrent_streams,
            Shard.status,
            Shard.advertised_at,
            Shard.expires_at,
            ShardHealth.last_seen,
            ShardHealth.queue_depth,
            ShardHealth.active_streams,
            ShardHealth.decode_step_ms,
            Shard.quantization,
            Shard.protocol,
            Shard.dtype,
            Shard.withdrawn_at,
            Shard.withdrawn_reason,
            ShardHealth.clock_skew_s,
            func.coalesce(ShardReputation.status == QUARANTINED, False).label("quarantined"),
            node_quarantined_by.label("node_quarantined_by"),
        )
        .outerjoin(ShardHealth, ShardHealth.shard_id == Shard.shard_id)
        .outerjoin(ShardReputation, ShardReputation.shard_id == Shard.shard_id)
        .order_by(Shard.model_id, Shard.shard_id)
    )
    if condition is not None:
        query = query.where(condition)
    return [ShardCandidate(**row._asdict()) for row in session.execute(query)]


@dataclass(frozen=True)
class KeptChain:
    """A chain whose hops kept a call's leading blocks: its shards and the layers each ran, and how many blocks (as
    the event log records it, or an orchestrator's own memory: hearth/services/orchestrator/prefix.py)."""

    hops: tuple[tuple[str, int, int], ...]
    blocks: int


def kept_chain_holding(session: Session, names: Sequence[str], now_s: float,
                       keeper: str | None) -> KeptChain | None:
    """The recorded chain keeping the most leading blocks of `names` (a call's block names, first to last), among
    records not expired at `now_s` that `keeper` signed (the looking-up orchestrator's member key, which its marks are
    drawn over; None on an open mesh: the unsigned records); None when no such record names one of them. Only its
    own member's records: another member may copy a mark from the log, but not sign as this one. Of a name's records,
    the latest kept (one per second: the key) names the chain, so a lookup too goes by event time alone."""
    signer = records_signer(keeper)
    for end in range(len(names), 0, -kept_names_per_lookup):
        start = max(0, end - kept_names_per_lookup)
        position = {name: index for index, name in enumerate(names[start:end], start=start)}
        found = session.execute(
            select(KeptPrefixRecord.name, KeptPrefixRecord.kept_at, KeptPrefixRecord.expires_at, KeptPrefixRecord.hops)
            .where(KeptPrefixRecord.signer == signer, KeptPrefixRecord.name.in_(list(position)))
        ).all()
        # Expiry is sifted here, not in SQL: a range on expires_at draws SQLite to the pruning index, through every
        # unexpired record of the signer, instead of the key's few rows per name.
        found = [row for row in found if row.expires_at >= now_s]
        if found:
            longest = max(found, key=lambda row: (position[row.name], row.kept_at))
            hops = tuple((shard_id, layer_lo, layer_hi) for shard_id, layer_lo, layer_hi in json.loads(longest.hops))
            return KeptChain(hops=hops, blocks=position[longest.name] + 1)
    return None


def shard_reputations(session: Session) -> list[ShardReputation]:
    """Every shard verification has spoken about: quarantined ones first, then by mismatches and disputes."""
    query = select(ShardReputation).order_by(
        (ShardReputation.status == QUARANTINED).desc(), ShardReputation.mismatches.desc(),
        ShardReputation.disputes.desc(), ShardReputation.shard_id)
    return list(session.scalars(query))


def quarantined_among(session: Session, shard_ids: Sequence[str]) -> set[str]:
    """Which of `shard_ids` are quarantined (a handful: the shards an orchestrator's own checks proved wrong)."""
    return set(session.scalars(select(ShardReputation.shard_id).where(
        ShardReputation.status == QUARANTINED, ShardReputation.shard_id.in_(list(shard_ids)))))


def shard_reputation(session: Session, shard_id: str) -> ShardReputation | None:
    return session.get(ShardReputation, shard_id)


def projection_positions(session: Session, projection: str = PROJECTION_NAME) -> dict[str, int]:
    """The last applied sequence per stream of `projection`."""
    return load_positions(session, projection)


def coverage_text(layer_replicas: Iterable[tuple[int, int]]) -> str:
    """Consecutive layers with the same number of replicas as one run: `0-1 x2, 2-3 x1, 4-5 MISSING`."""
    runs = []
    for replicas, run in groupby(layer_replicas, key=lambda pair: pair[1]):
        layers = [layer for layer, _ in run]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"
        runs.append(f"{span} MISSING" if replicas == 0 else f"{span} x{replicas}")
    return ", ".join(runs)
