"""The roles `hearth doctor --role` prepares for, and what each one needs: the roster role its key must hold, the
event streams it reads, whether it holds a model and plans within a memory budget."""

from __future__ import annotations

from typing import Literal

from hearth.events.streams import ALL_STREAMS, SHARDS_STREAM
from hearth.services.common.call_nonces import CALL_NONCES_STREAM
from hearth.trust.roster import Role

DoctorRole = Literal["shard", "host", "orchestrator", "projector", "client", "gateway"]
DOCTOR_ROLES: tuple[DoctorRole, ...] = ("shard", "host", "orchestrator", "projector", "client", "gateway")
# The roster role whose key each command logs in with: `hearth host` serves shards; the gateway calls orchestrators.
ROSTER_ROLE: dict[DoctorRole, Role] = {"shard": "shard", "host": "shard", "orchestrator": "orchestrator",
                                       "projector": "projector", "client": "client", "gateway": "client"}
# The streams each one waits for at start (the steward creates them); the broker's permissions let it read them.
STREAMS_READ: dict[DoctorRole, tuple[str, ...]] = {
    "shard": (SHARDS_STREAM,), "host": (SHARDS_STREAM,), "orchestrator": (*ALL_STREAMS, CALL_NONCES_STREAM),
    "projector": ALL_STREAMS, "client": (), "gateway": ()}
# The roles that take --model, and those of them that must fit a layer in a memory budget.
MODEL_ROLES: tuple[DoctorRole, ...] = ("shard", "host", "orchestrator")
BUDGET_ROLES: tuple[DoctorRole, ...] = ("shard", "host")
# The roles that call the orchestrators: their broker checks ask which models the mesh serves.
CALLER_DOCTOR_ROLES: tuple[DoctorRole, ...] = ("client", "gateway")
