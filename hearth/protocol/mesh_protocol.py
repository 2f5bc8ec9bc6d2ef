"""The mesh protocol's version: what shards and orchestrators say they speak, and the one line that refuses a peer
speaking another."""

from __future__ import annotations

# Raised whenever a change to what shards and orchestrators say to each other (`open`, activation frames, notices,
# keepalives) would make a peer of the previous version fail, or to the weights a scheme's label stands for (a
# pipeline or failover mixing them would not give one version's tokens); a shard advertises it and an
# orchestrator's `open` carries it. 1 is every hearth from before it was told (adverts and opens without the field);
# 3 holds a 4-bit mix's more precise matrices in int8 under int4 (hearth/inference/held_forms.py); 4 rounds weights
# into int4 groups over a searched range (hearth/inference/weight_codes.py).
MESH_PROTOCOL = 4
UNVERSIONED_MESH_PROTOCOL = 1
# Far above any version there will be: a bound on what a peer may claim.
max_mesh_protocol = 2**15


def mesh_protocol_refusal(theirs: int | None, peer: str) -> str | None:
    """Why this process cannot work with `peer` (e.g. "shard X", "the orchestrator") speaking mesh protocol `theirs`
    (None: a hearth from before protocol versions), in one line naming both versions; None when it speaks ours."""
    told = UNVERSIONED_MESH_PROTOCOL if theirs is None else theirs
    if told == MESH_PROTOCOL:
        return None
    older = " (a hearth from before protocol versions)" if theirs is None else ""
    upgrade = peer if told < MESH_PROTOCOL else "this one"
    return (f"{peer} speaks hearth mesh protocol {told}{older}, this one {MESH_PROTOCOL}: "
            f"a mesh runs one version, upgrade {upgrade}")
