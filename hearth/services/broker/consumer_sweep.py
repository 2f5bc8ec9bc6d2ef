"""Deletes the consumers of the community's streams that hearth's readers would never make: the broker checks who
may create a consumer on a stream, not what the request asks (nats-server issue 8274), so a reader could have a
stream pushed onto any subject (another member's request or activation subjects among them), keep a pull consumer
or take every place the stream's consumer cap allows. The streams' own limits (events/streams.py) bound the rest:
every consumer is deleted by the server once inactive, and a stream holds a bounded number.

A consumer may stay when it pushes to the inbox (`_INBOX.<member>.…`) of a member who may read that stream, names an
inactivity limit within the stream's, and is among the first `max_consumers_per_member` of that member on the
stream; any other, and any whose settings do not read, is deleted. The consumers are read as the broker's JSON, not
through a client's models: a member chooses what its consumer's settings hold. A sweep runs every
`sweep_interval_s` and as soon as the broker announces a new consumer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hearth.events.signing import RosterFile
from hearth.events.streams import ALL_STREAMS, consumer_inactive_limit_s, weights_consumer_inactive_limit_s
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

# Each swept stream with the longest inactivity limit its consumers may name.
SWEPT_STREAMS: dict[str, float] = {**{stream: consumer_inactive_limit_s for stream in ALL_STREAMS},
                                   WEIGHTS_STREAM: weights_consumer_inactive_limit_s}
# Consumers one member may hold on one stream: a process reads each stream through one at a time, a weights fetch
# leaves one per object for a few seconds.
max_consumers_per_member = 64
# How often `hearth nats --community` sweeps besides the sweep each new consumer sets off.
sweep_interval_s = 10.0
api_timeout_s = 5.0
# How often a wait between sweeps looks whether it was asked to stop.
stop_poll_s = 0.2
_NANOSECONDS = 1_000_000_000
_STREAM_NOT_FOUND_ERR_CODE = 10059
CONSUMER_CREATED_ADVISORIES = "$JS.EVENT.ADVISORY.CONSUMER.CREATED.>"


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


def owner_or_why_not(config: dict, readers: frozenset[str], inactive_limit_s: float) -> tuple[str | None, str]:
    """(the member whose inbox the consumer pushes to, "") when it may stay, else (None, why it must go)."""
    deliver = config.get("deliver_subject")
    if not deliver:
        return None, "a pull consumer (hearth's readers push to their inbox)"
    if not (isinstance(deliver, str) and is_member_inbox(deliver) and deliver.split(".")[1] in readers):
        return None, f"it delivers to {deliver!r}, not the inbox of a member who reads the stream"
    threshold = config.get("inactive_threshold")
    if type(threshold) is not int or not 0 < threshold <= inactive_limit_s * _NANOSECONDS:
        return None, "it has no inactivity limit within the stream's, so it would outlive its member"
    return deliver.split(".")[1], ""


def unwanted(consumers: list[dict], readers: frozenset[str], inactive_limit_s: float) -> dict[str, str]:
    """consumer name -> why it must go, of `consumers` (the broker's JSON, oldest first) on one stream."""
    verdicts: dict[str, str] = {}
    held: dict[str, int] = {}
    for entry in consumers:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            continue
        config = entry.get("config")
        if not isinstance(config, dict):
            verdicts[name] = "its settings do not read"
            continue
        owner, why = owner_or_why_not(config, readers, inactive_limit_s)
        if owner is not None:
            held[owner] = held.get(owner, 0) + 1
            if held[owner] > max_consumers_per_member:
                why = f"{owner} holds more than {max_consumers_per_member} consumers of the stream"
        if why:
            verdicts[name] = why
    return verdicts


async def sweep_consumers(nc, roster: Roster, streams: Iterable[str] = SWEPT_STREAMS) -> list[SweptConsumer]:
    """Delete every unwanted consumer of `streams` (one that does not exist is skipped); what was deleted."""
    streams = tuple(streams)
    readers = stream_readers(roster, streams)
    swept: list[SweptConsumer] = []
    for stream in streams:
        consumers = await listed_consumers(nc, stream)
        consumers.sort(key=lambda entry: str(entry.get("created", "")) if isinstance(entry, dict) else "")
        for name, why in unwanted(consumers, readers[stream], SWEPT_STREAMS.get(stream, 0.0)).items():
            if await _delete_consumer(nc, stream, name):
                swept.append(SweptConsumer(stream, name, why))
    return swept


async def _api(nc, subject: str, body: bytes = b"") -> dict:
    reply = await nc.request(subject, body, timeout=api_timeout_s)
    answer = json.loads(reply.data)
    if not isinstance(answer, dict):
        raise ValueError(f"{subject}: the broker answered {type(answer).__name__}")
    return answer


async def listed_consumers(nc, stream: str) -> list:
    consumers: list = []
    while True:
        page = await _api(nc, f"{JS_API}.CONSUMER.LIST.{stream}", json.dumps({"offset": len(consumers)}).encode())
        error = page.get("error")
        if isinstance(error, dict) and error.get("err_code") == _STREAM_NOT_FOUND_ERR_CODE:
            return []
        if error:
            raise RuntimeError(f"listing the consumers of {stream}: {error}")
        entries = page.get("consumers") or []
        consumers += entries
        if not entries or len(consumers) >= int(page.get("total", 0)):
            return consumers


async def _delete_consumer(nc, stream: str, name: str) -> bool:
    answer = await _api(nc, f"{JS_API}.CONSUMER.DELETE.{stream}.{name}")
    return answer.get("success") is True  # else gone meanwhile, or a name no subject can carry


class ConsumerSweeper:
    """Sweeps every `interval_s`, and at once when a consumer is created, on a thread of its own (the broker's
    process has no event loop), connected as the steward (`system_key`); `report` hears of each consumer deleted.
    Failures are logged and tried at the next sweep."""

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

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def _sweep_until_stopped(self) -> None:
        connection = None
        created = asyncio.Event()

        async def consumer_created(_msg) -> None:
            created.set()

        try:
            while not self._stop.is_set():
                try:
                    if connection is None or connection.is_closed:
                        connection = await connect_nats(self.settings.url, name="hearth consumer sweep",
                                                        settings=self.settings)
                        await connection.subscribe(CONSUMER_CREATED_ADVISORIES, cb=consumer_created)
                    created.clear()
                    for swept in await sweep_consumers(connection, self.roster_file.current()):
                        self.report(swept)
                except Exception as error:  # the broker restarting, JetStream without a leader yet: next time
                    log.warning("consumer sweep failed (%s); trying again in %g s", error, self.interval_s)
                await self._wait_for_next_sweep(created)
        finally:
            if connection is not None:
                await close_quietly(connection, self.settings.close_timeout_s)

    async def _wait_for_next_sweep(self, created: asyncio.Event) -> None:
        """Until a consumer is created, `interval_s` passed or a stop was asked for."""
        deadline = asyncio.get_running_loop().time() + self.interval_s
        while not self._stop.is_set() and not created.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(created.wait(), min(left, stop_poll_s))
