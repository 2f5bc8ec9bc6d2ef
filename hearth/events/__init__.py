"""hearth's event log: the event models, their subjects and streams, and publishing to / reading from JetStream."""

from hearth.events.consume import (
    SkippedMessage,
    StoredEvent,
    StreamReadStalled,
    decode_stored_message,
    read_stream,
    stream_last_seq,
)
from hearth.events.models import EVENT_TYPES, Event, EventEnvelope, decode_event, encode_event
from hearth.events.publish import MSG_ID_HEADER, publish_event
from hearth.events.streams import (
    ALL_STREAMS,
    PIPELINES_STREAM,
    SHARDS_STREAM,
    STREAM_SPECS,
    ensure_streams,
    stream_for_subject,
)
from hearth.protocol.subjects import event_subject, shard_key

__all__ = [
    "ALL_STREAMS",
    "EVENT_TYPES",
    "Event",
    "EventEnvelope",
    "MSG_ID_HEADER",
    "PIPELINES_STREAM",
    "SHARDS_STREAM",
    "STREAM_SPECS",
    "SkippedMessage",
    "StoredEvent",
    "StreamReadStalled",
    "decode_event",
    "decode_stored_message",
    "encode_event",
    "ensure_streams",
    "event_subject",
    "publish_event",
    "read_stream",
    "shard_key",
    "stream_for_subject",
    "stream_last_seq",
]
