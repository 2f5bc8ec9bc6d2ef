"""Test factories of the verification outcome events (integrity.*) that the reputation read model projects."""

from __future__ import annotations

from hearth.events.models import (
    IntegrityMismatchConfirmed,
    IntegrityMismatchDisputed,
    IntegrityQuarantineCleared,
    IntegrityShardsVerified,
    ShardVerification,
)
from tests.readmodel_helpers import at

EVIDENCE_SHA = "e7" * 32


def verified(pipeline_id: str, counts: dict[str, tuple[int, int]], *, t: float = 3.0) -> IntegrityShardsVerified:
    """`counts`: shard_id -> (checks, verified_positions)."""
    return IntegrityShardsVerified(
        pipeline_id=pipeline_id, node_id="hub", occurred_at=at(t),
        shards=[ShardVerification(shard_id=shard_id, checks=checks, verified_positions=positions)
                for shard_id, (checks, positions) in counts.items()],
    )


def _evidence(lo: int = 0, hi: int = 3, position: int = 17) -> dict:
    return dict(layer_lo=lo, layer_hi=hi, quantization="none", dtype="float32", position=position,
                step_kind="decode", relative_error=0.42, tolerance=0.002, evidence_sha256=EVIDENCE_SHA)


def confirmed(pipeline_id: str, shard_id: str, witnesses: list[str], *, t: float = 4.0,
              **evidence) -> IntegrityMismatchConfirmed:
    return IntegrityMismatchConfirmed(pipeline_id=pipeline_id, node_id="hub", occurred_at=at(t), shard_id=shard_id,
                                      witnesses=witnesses, **{**_evidence(), **evidence})


def disputed(pipeline_id: str, shard_ids: list[str], *, t: float = 4.0) -> IntegrityMismatchDisputed:
    return IntegrityMismatchDisputed(pipeline_id=pipeline_id, node_id="hub", occurred_at=at(t), shard_ids=shard_ids,
                                     **_evidence())


def cleared(shard_id: str, *, t: float = 10.0, reason: str = "replaced the faulty GPU",
            clearing_id: str = "clear-00ff") -> IntegrityQuarantineCleared:
    return IntegrityQuarantineCleared(pipeline_id=clearing_id, node_id="system", occurred_at=at(t),
                                      shard_id=shard_id, reason=reason)
