"""Turns log items into hearth-replay output lines: a readable table row or one JSON object per line (and a broker's
failure into one line)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from hearth.events.consume import SkippedMessage, StoredEvent
from hearth.protocol.display_text import display_text

LogItem = StoredEvent | SkippedMessage

# The signature fields are envelope too: a table row about what happened does not need 150 characters of key.
ENVELOPE_FIELDS = frozenset({"event_id", "type", "version", "occurred_at", "node_id", "signer", "signature"})
# Fields that name the subject of an event; shown first in the summary.
IDENTITY_FIELDS = ("shard_id", "pipeline_id")
max_value_chars = 80


def format_time(value: datetime) -> str:
    """UTC with milliseconds and a Z, e.g. 2026-11-21T12:00:01.250Z."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _format_value(value: Any) -> str:
    if isinstance(value, list):
        text = "[" + ", ".join(str(item) for item in value) + "]"
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    text = display_text(text)  # members wrote it: no escape sequence, no line of its own
    return text if len(text) <= max_value_chars else text[: max_value_chars - 1] + "…"


def event_fields(event: Any, *, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An event's own fields (no envelope), identity fields first."""
    data = event.model_dump(mode="json")
    ordered = {name: data[name] for name in IDENTITY_FIELDS if name in data}
    ordered.update((name, value) for name, value in data.items() if name not in ordered)
    return {name: value for name, value in ordered.items() if name not in ENVELOPE_FIELDS | exclude}


def summarize_event(event: Any, *, exclude: frozenset[str] = frozenset()) -> str:
    return " ".join(f"{name}={_format_value(value)}" for name, value in event_fields(event, exclude=exclude).items())


def table_row(item: LogItem) -> str:
    where = f"{item.stream}#{item.seq}"
    if isinstance(item, SkippedMessage):
        return display_text(f"{format_time(item.time)}  {where:<22} {'UNDECODABLE':<30} {item.subject}: {item.error}")
    event = item.event
    return display_text(f"{format_time(item.time)}  {where:<22} {event.type:<30} {summarize_event(event)} "
                        f"node={event.node_id}")


def json_record(item: LogItem) -> dict[str, Any]:
    record: dict[str, Any] = {
        "stream": item.stream,
        "seq": item.seq,
        "subject": item.subject,
        "time": item.time.astimezone(timezone.utc).isoformat(),
    }
    if isinstance(item, SkippedMessage):
        record["skipped"] = True
        record["error"] = item.error
    else:
        record["headers"] = item.headers
        record["event"] = item.event.model_dump(mode="json")
    return record


def jsonl_line(item: LogItem, **extra: Any) -> str:
    return json.dumps({**json_record(item), **extra}, ensure_ascii=False, separators=(",", ":"))


def broker_failure_line(error: Exception) -> str:
    """The one line for a broker that was reached but failed a request (JetStream off, refused, gone mid-read)."""
    import nats.errors
    import nats.js.errors

    if isinstance(error, (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)):
        return "the broker answers no JetStream request (JetStream is off there, or not ready yet)"
    detail = getattr(error, "description", None) or str(error) or type(error).__name__
    return f"the broker failed a JetStream request: {detail}"
