"""Prometheus counters for the event log itself (defined here because hearth/events/ must not import
hearth/services/)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

events_undecodable_total = Counter(
    "hearth_events_undecodable_total",
    "Messages on an event subject that did not decode into a known event (skipped, never fatal).",
    ["stream"],
)

events_published_total = Counter(
    "hearth_events_published_total",
    "Events acknowledged by JetStream, by event type (duplicates dropped by the server included).",
    ["type"],
)

event_outbox_depth = Gauge(
    "hearth_event_outbox_depth",
    "Audit events recorded by this process (or left in its outbox file by a previous one) and waiting to be written "
    "to JetStream.",
)

events_rejected_total = Counter(
    "hearth_events_rejected_total",
    "Events a projection did not apply because their signature, signer, role, node or time failed the "
    "community's check (hearth/events/signing.py), no handler could apply them, they are a copy of an event "
    "applied already (duplicate) or older than its id is kept (too_old), or only a newer hearth reads them "
    "(newer_hearth); each is also counted in the rejected_event_counts read model.",
    ["reason"],
)

skewed_clock_messages_total = Counter(
    "hearth_skewed_clock_messages_total",
    "Calls, opens and events whose signer's date is beyond [events] max_clock_skew_s of the clock that checked it "
    "(hearth/events/clock_skew.py): its clock, or the checker's, is off.",
    ["what"],
)

broker_clock_offset_seconds = Gauge(
    "hearth_broker_clock_offset_seconds",
    "This process's clock less the broker's, as last measured (hearth/events/broker_clock.py): beyond [events] "
    "max_clock_skew_s its signed events, calls or opens are refused.",
)
