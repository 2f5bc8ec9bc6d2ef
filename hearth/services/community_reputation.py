"""Shard hosts' reputation as a read model holds it, read with plain SQL on a read-only connection (the projector
may be writing), and the steward's clearing of a quarantine (a signed `integrity.quarantine_cleared`), whose
publisher is handed in as a function so the logic is tested without a broker."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearth.events.models import EventEnvelope, IntegrityQuarantineCleared
    from hearth.services.common.config import NatsSettings
    from hearth.trust.keys import MemberKey

REPUTATION_LISTING_SQL = """SELECT shard_id, COALESCE(node_id, ''), status, checks, verified_positions, mismatches,
       disputes, status_since, COALESCE(status_reason, ''),
       (SELECT COUNT(*) FROM integrity_evidence e WHERE e.shard_id = r.shard_id AND e.kind = 'unheld')
FROM shard_reputation r
ORDER BY status = 'quarantined' DESC, mismatches DESC, disputes DESC, shard_id"""

Publish = Callable[["EventEnvelope"], Awaitable[None]]


class ReadModelMissing(Exception):
    """The read model a reputation command reads is absent or not migrated to a schema with reputation."""


class NotQuarantined(Exception):
    """The shard a steward asked to clear is not quarantined in the read model: nothing was published."""


@dataclass(frozen=True)
class ShardReputationRow:
    shard_id: str
    node_id: str
    status: str
    checks: int
    verified_positions: int
    mismatches: int
    disputes: int
    status_since: int | None
    status_reason: str
    # Confirmed mismatches that quarantined nobody: their reporter already held the most nodes one member's word may.
    unheld: int

    @property
    def quarantined(self) -> bool:
        return self.status == "quarantined"


def read_reputation(db: Path) -> list[ShardReputationRow]:
    """Every shard verification has spoken about, quarantined ones first (ReadModelMissing when it cannot)."""
    if not db.is_file():
        raise ReadModelMissing(f"no read model at {db} (give --db, the file `hearth projector --db` keeps)")
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return [ShardReputationRow(*row) for row in connection.execute(REPUTATION_LISTING_SQL)]
    except sqlite3.OperationalError as error:
        raise ReadModelMissing(f"{db} holds no reputation ({error}); run `hearth db upgrade --db {db}`") from None
    except sqlite3.DatabaseError as error:  # no SQLite database at all (another file given as --db)
        raise ReadModelMissing(f"{db} is not a read model SQLite can read ({error})") from None
    finally:
        connection.close()


def format_instant(epoch_s: int | None) -> str:
    if epoch_s is None:
        return "-"
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def reputation_lines(rows: list[ShardReputationRow]) -> list[str]:
    """The `hearth community reputation` listing: a summary (with the nodes a quarantine holds), then one line per
    shard (and its reason, and for a shard not quarantined itself the quarantine of its node that holds it out)."""
    from hearth.protocol.quarantine import MAX_NODES_HELD_PER_REPORTER, node_quarantine_reason, quarantined_nodes

    quarantined = sum(row.quarantined for row in rows)
    held = quarantined_nodes(row.shard_id for row in rows if row.quarantined)
    nodes = f"; nodes held (none of their shards is routed): {', '.join(sorted(held))}" if held else ""
    lines = [f"{len(rows)} shards with verification outcomes, {quarantined} quarantined{nodes}"]
    for row in rows:
        since = f" since {format_instant(row.status_since)}" if row.status_since is not None else ""
        lines.append(f"{row.status.upper() if row.quarantined else row.status:11} {row.node_id:16} {row.shard_id}  "
                     f"checks {row.checks}, verified positions {row.verified_positions}, mismatches "
                     f"{row.mismatches}, disputes {row.disputes}{since}")
        if row.status_reason:
            lines.append(f"{'':11} {'cleared: ' if not row.quarantined else ''}{row.status_reason}")
        if row.unheld:
            lines.append(f"{'':11} {row.unheld} confirmed mismatches quarantined nobody: their reporter's checks "
                         f"already held {MAX_NODES_HELD_PER_REPORTER} nodes; read them with hearth-replay shard")
        if not row.quarantined and row.node_id in held:
            lines.append(f"{'':11} not routed: {node_quarantine_reason(row.node_id, held[row.node_id])}")
    return lines


def quarantined_shards_by_node(db: Path) -> dict[str, list[str]]:
    """node -> its quarantined shard ids; empty when there is no read model to ask."""
    try:
        rows = read_reputation(db)
    except ReadModelMissing:
        return {}
    by_node: dict[str, list[str]] = {}
    for row in rows:
        if row.quarantined:
            by_node.setdefault(row.node_id, []).append(row.shard_id)
    return by_node


def quarantine_clearing(shard_id: str, reason: str, steward_key: MemberKey) -> IntegrityQuarantineCleared:
    """The signed event a steward publishes; its `pipeline_id` is the clearing's own id."""
    from hearth.events.models import IntegrityQuarantineCleared
    from hearth.events.signing import sign_event
    from hearth.trust.roster import SYSTEM_MEMBER

    event = IntegrityQuarantineCleared(pipeline_id=f"clear-{uuid.uuid4().hex}", node_id=SYSTEM_MEMBER,
                                       shard_id=shard_id, reason=reason)
    return sign_event(event, steward_key)  # type: ignore[return-value]


async def clear_quarantine(shard_id: str, reason: str, *, db: Path, steward_key: MemberKey,
                           publish: Publish) -> IntegrityQuarantineCleared:
    """Publish the clearing of `shard_id`'s quarantine; NotQuarantined (nothing published) when the read model
    does not hold it quarantined, ReadModelMissing when there is no read model to ask."""
    row = next((row for row in read_reputation(db) if row.shard_id == shard_id), None)
    if row is None or not row.quarantined:
        state = "never checked" if row is None else f"status {row.status}"
        raise NotQuarantined(f"shard {shard_id} is not quarantined in {db} ({state}); nothing was published")
    event = quarantine_clearing(shard_id, reason, steward_key)
    await publish(event)
    return event


def steward_publisher(nats: NatsSettings, system_key: Path) -> Publish:
    """A Publish that connects to `nats.url` as the steward (`system_key`), publishes the (already signed) event
    to its stream and closes the connection."""

    async def publish(event: EventEnvelope) -> None:
        from hearth.events.publish import publish_event
        from hearth.events.streams import missing_streams, stream_for_subject, streams_missing
        from hearth.protocol.subjects import event_subject
        from hearth.services.broker.connection import steward_connection

        async with steward_connection(nats, system_key) as connection:
            js = connection.jetstream()
            # A missing stream would cost the publish its whole retry schedule before failing.
            if missing := await missing_streams(js, [stream_for_subject(event_subject(event))]):
                raise streams_missing(missing, nats.url)
            await publish_event(js, event)

    return publish
