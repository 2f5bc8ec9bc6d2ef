"""Stand-ins for the JetStream an EventOutbox publishes to: one that stores nothing, one that records every publish."""

from __future__ import annotations


class _Connected:
    is_reconnecting = False


class BrokerStoringNothing:
    """Every publish fails, as a broker without a stream answering does."""

    _nc = _Connected()

    async def publish(self, *args, **kwargs):
        raise RuntimeError("no stream answers")


class RecordingBroker:
    """Stores every publish: its body and its id (Nats-Msg-Id), in the order written."""

    _nc = _Connected()

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.msg_ids: list[str] = []

    async def publish(self, subject, payload, timeout, headers):
        self.payloads.append(payload)
        self.msg_ids.append(headers["Nats-Msg-Id"])
