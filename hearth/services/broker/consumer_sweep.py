"""Deletes the consumers of the community's streams that deliver anywhere but the inbox of a member who may read
that stream, and those that carry no inactivity limit: the broker checks who may create a consumer on a stream, not
what the request asks (nats-server issue 8274), so a reader could have a stream pushed onto any subject, another
member's request or activation subjects among them. The streams' own limits (events/streams.py) bound everything
else: every consumer made since is deleted by the server once inactive, and a stream holds a bounded number."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from hearth.events.signing import RosterFile
from hearth.events.streams import ALL_STREAMS, consumer_inactive_limit_s
from hearth.services.broker.connection import close_quietly, connect_nats
from hearth.services.broker.permissions import (
    JS_API,
    WEIGHTS_STREAM,
    admitted,
    is_member_inbox,
    role_permissions,
)
from hearth.services.common.config import NatsSettings
from hearth.trust.roster import Roster

log = logging.getLogger(__name__)

SWEPT_STREAMS: tuple[str, ...] = (*ALL_STREAMS, WEIGHTS_STREAM)
# How often `hearth nats --community` looks: a foreign consumer pushes for at most about this long.
sweep_interval_s = 10.0
# The broker's consumer listing comes in pages of at most this many.
consumer_list_page = 256


@dataclass(frozen=True)
class SweptConsumer:
    stream: str
    name: str
    why: str


def stream_readers(roster: Roster, streams: Iterable[str] = SWEPT_STREAMS) -> dict[str, frozenset[str]]:
    """stream -> the names of the members the broker lets create consumers on it (their role's permissions)."""
    readers: dict[str, set[str]] = {stream: set() for stream in streams}
    for member in roster.members:
        if not admitted(member):
            continue
        granted = set(role_permissions(member.role, member.name).publish)
        for stream, names in readers.items():
            if ">" in granted or f"{JS_API}.CONSUMER.CREATE.{stream}.*" in granted:
                names.add(member.name)
    return {stream: frozenset(names) for stream, names in readers.items()}


def why_unwanted(config: ConsumerConfig, readers: frozenset[str]) -> str | None:
    """Why a consumer with `config` on a stream read by `readers` must go, or None when it may stay."""
    deliver = config.deliver_subject
    if deliver and not (is_member_inbox(deliver) and deliver.split(".")[1] in readers):
        return f"it delivers to {deliver!r}, not the inbox of a member who reads the stream"
    threshold = config.inactive_threshold
    if threshold is None or threshold <= 0 or threshold > consumer_inactive_limit_s:
        return "it has no inactivity limit (made before the stream's limits), so it would outlive its member"
    return None


async def sweep_consumers(js, roster: Roster, streams: Iterable[str] = SWEPT_STREAMS) -> list[SweptConsumer]:
    """Delete every unwanted consumer of `streams` (a stream that does not exist is skipped); what was deleted."""
    streams = tuple(streams)
    readers = stream_readers(roster, streams)
    swept: list[SweptConsumer] = []
    for stream in streams:
        try:
            consumers = await _all_consumers(js, stream)
        except NotFoundError:
            continue
        for info in consumers:
            why = why_unwanted(info.config, readers[stream])
            if why is None:
                continue
            try:
                await js.delete_consumer(stream, info.name)
            except NotFoundError:  # gone meanwhile
                continue
            swept.append(SweptConsumer(stream, info.name, why))
    return swept


async def _all_consumers(js, stream: str) -> list:
    consumers: list = []
    while True:
        page = await js.consumers_info(stream, offset=len(consumers))
        consumers += page
        if len(page) < consumer_list_page:
            return consumers


class ConsumerSweeper:
    """Sweeps every `interval_s` on a thread of its own (the broker's process has no event loop), connected as the
    steward (`system_key`); `report` hears of each consumer deleted. Failures are logged and tried at the next sweep."""

    def __init__(self, settings: NatsSettings, system_key: Path, roster_path: Path, *,
                 report: Callable[[SweptConsumer], None], interval_s: float = sweep_interval_s) -> None:
        self.settings = settings.model_copy(update={"creds_file": system_key})
        self.roster_file = RosterFile(roster_path)
        self.report = report
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._sweep_until_stopped()),
                                        name="hearth-consumer-sweep", daemon=True)

    def start(self) -> "ConsumerSweeper":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    async def _sweep_until_stopped(self) -> None:
        connection = None
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                try:
                    if connection is None or connection.is_closed:
                        connection = await connect_nats(self.settings.url, name="hearth consumer sweep",
                                                        settings=self.settings)
                    for swept in await sweep_consumers(connection.jetstream(), self.roster_file.current()):
                        self.report(swept)
                except Exception as error:  # the broker restarting, JetStream without a leader yet: next time
                    log.warning("consumer sweep failed (%s); trying again in %g s", error, self.interval_s)
                await loop.run_in_executor(None, self._stop.wait, self.interval_s)
        finally:
            if connection is not None:
                await close_quietly(connection, self.settings.close_timeout_s)
