"""An event a stream takes none of for minutes (a broker whose store met a full disk answers no publish) is said
once: the outbox's WARNING and its first publish's retries, not every later attempt's."""

from __future__ import annotations

import asyncio
import logging

import nats.errors

from hearth.events import publish
from hearth.events.models import ShardWithdrawn
from hearth.events.outbox import EventOutbox
from tests.outbox_brokers import BrokerStoringNothing


class BrokerAnsweringNoPublish(BrokerStoringNothing):
    """Every publish times out, as on a stream whose store's disk filled."""

    def __init__(self) -> None:
        self.publishes = 0

    async def publish(self, *args, **kwargs):
        self.publishes += 1
        raise nats.errors.TimeoutError


async def test_an_event_the_stream_keeps_refusing_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(publish, "publish_retry_initial_wait_s", 0.0001)
    monkeypatch.setattr(publish, "publish_retry_max_wait_s", 0.0001)
    broker = BrokerAnsweringNoPublish()
    outbox = EventOutbox(broker, max_queued=4, retry_wait_s=0.001)
    outbox.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="hearth.events"):
            await outbox.record(ShardWithdrawn(node_id="n", shard_id="s1", reason="shutdown"))
            async with asyncio.timeout(10):
                while broker.publishes < 6 * publish.publish_max_attempts:  # six whole publishes, each retried
                    await asyncio.sleep(0.01)
            warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    finally:
        await outbox.stop(0.0)
    first_publish_retries = publish.publish_max_attempts - 1
    assert len(warnings) == first_publish_retries + 1, warnings
    assert sum("not written yet" in warning for warning in warnings) == 1
    assert sum(record.levelno == logging.DEBUG and "attempt" in record.getMessage()
               for record in caplog.records) >= 5 * first_publish_retries  # the later ones are kept, at DEBUG
