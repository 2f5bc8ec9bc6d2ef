"""Creates (or brings to the current spec) the event streams, the orchestrators' call-nonce bucket
(hearth/services/common/call_nonces.py) and the weights bucket's bound (weights_bucket.py) on a community's broker
with the steward's own key, the `system` member's: on a community broker no other member may administer a stream
(hearth/services/broker/permissions.py), so `hearth nats --community`, `hearth community streams` and LocalCluster
call this once the broker is up."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from hearth.events.streams import StreamsIncompatible, ensure_streams
from hearth.services.common.call_nonces import ensure_call_nonces
from hearth.services.common.config import NatsSettings
from hearth.services.broker.connection import steward_connection
from hearth.services.broker.weights_bucket import WeightsBucketError, ensure_weights_bucket

log = logging.getLogger(__name__)

# A cluster that has just started elects its JetStream leader first: creating a stream fails until then.
retry_interval_s = 0.5


async def create_community_streams(nats: NatsSettings, system_key: Path, *, ready_timeout_s: float,
                                   weights_max_bytes: int | None = None) -> None:
    """Connect to `nats.url` as the steward (`system_key`) and ensure both streams and the call-nonce bucket (three
    copies on a cluster, one on a single server), then the weights bucket bounded to `weights_max_bytes` (None: left
    as it is), trying again for up to `ready_timeout_s` while JetStream is not ready yet."""
    async with steward_connection(nats, system_key) as nc:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                await ensure_streams(nc.jetstream())
                await ensure_call_nonces(nc.jetstream())
                if weights_max_bytes is not None:  # after the streams: their reservations come first
                    await ensure_weights_bucket(nc.jetstream(), weights_max_bytes)
                return
            except (StreamsIncompatible, WeightsBucketError):  # no later try passes: say so now
                raise
            except Exception as error:  # JetStream not ready (no leader yet): the next try may pass
                if time.monotonic() >= deadline:
                    raise
                log.debug("creating the event streams: %s; trying again", error)
                await asyncio.sleep(retry_interval_s)


def create_community_streams_blocking(nats: NatsSettings, system_key: Path, *, ready_timeout_s: float,
                                      weights_max_bytes: int | None = None) -> None:
    """create_community_streams from synchronous code, which may itself run inside an event loop (a test's):
    in a thread of its own with its own loop."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(create_community_streams(nats, system_key, ready_timeout_s=ready_timeout_s,
                                                 weights_max_bytes=weights_max_bytes))
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="hearth-steward-streams")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
