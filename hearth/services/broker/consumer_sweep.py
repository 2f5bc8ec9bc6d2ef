"""Deletes the consumers of the community's streams that hearth's readers would never make: the broker checks who
may create a consumer on a stream, not what the request asks (nats-server issue 8274), so a reader could have a
stream pushed onto any subject (another member's request or activation subjects among them), keep a pull consumer
or take every place the stream's consumer cap allows. The streams' own limits (events/streams.py) bound the rest:
every consumer is deleted by the server once inactive, and a stream holds a bounded number.

A consumer may stay when it pushes to the inbox (`_INBOX.<member>.…`) of the member who created it, that member may
read the stream, it names an inactivity limit within the stream's, and it is among the first
`max_consumers_per_member` of its creator on the stream; any other, and any whose settings do not read, is deleted.
Who created a consumer is what the broker's API audit advisory says (`ConsumerCreators`: the key it logged in with);
of a consumer created while the sweeper was away the inbox owner stands in. The consumers are read as the broker's
JSON, not through a client's models: a member chooses what its consumer's settings hold. A sweep runs every
`sweep_interval_s` and as soon as the broker audits a consumer's creation."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hearth.events.cancellation import keeping_cancellation
from hearth.events.signing import RosterFile
from hearth.events.streams import ALL_STREAMS, consumer_inactive_limit_s, weights_consumer_inactive_limit_s
from hearth.services.broker.connection import (close_quietly, connect_nats, connected_keeping_cancellation,
                                               connection_identity, flush_ordered)
from hearth.services.broker.permissions import (
    JS_API,
    WEIGHTS_STREAM,
    admitted,
    is_member_inbox,
    role_permissions,
)
from hearth.services.common.config import NatsSettings
from hearth.services.common.lifecycle import event_within
from hearth.trust.roster import SYSTEM_MEMBER, Roster

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
# The broker's audit of every JetStream API call: who made it (the key it logged in with), the request, the answer.
API_AUDIT_ADVISORIES = "$JS.EVENT.ADVISORY.API"
_CONSUMER_CREATE_PREFIXES = (f"{JS_API}.CONSUMER.CREATE.", f"{JS_API}.CONSUMER.DURABLE.CREATE.")
# Creations remembered at most: the live consumers of the swept streams, with room for those created between sweeps.
max_remembered_creations = 4 * 1024 * len(SWEPT_STREAMS)


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


class ConsumerCreators:
    """Who created which consumer, from the broker's API audit advisories: (stream, consumer name) -> the
    consumer's creation time as the broker answered it and the member whose key asked. Only the steward may publish
    advisories, so a member cannot name another as a creator. Bounded: `forget_absent` drops what a listing no
    longer shows, and past `max_remembered_creations` the oldest go."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max_remembered_creations if limit is None else limit
        self._created: OrderedDict[tuple[str, str], tuple[str, str, float]] = OrderedDict()

    def record(self, advisory: object, roster: Callable[[], Roster]) -> bool:
        """Take note of `advisory` (the parsed JSON) if it audits a consumer's successful creation by a member of
        `roster()` (asked only then); whether it did."""
        if not isinstance(advisory, dict) or not str(advisory.get("subject", "")).startswith(_CONSUMER_CREATE_PREFIXES):
            return False
        client = advisory.get("client")
        key = client.get("user") if isinstance(client, dict) else None
        member = roster().by_key(key) if isinstance(key, str) else None
        try:
            answer = json.loads(advisory.get("response") or "null")
        except (TypeError, ValueError):
            return False
        if member is None or not isinstance(answer, dict) or "error" in answer:
            return False
        stream, name, created = answer.get("stream_name"), answer.get("name"), answer.get("created")
        if not all(isinstance(value, str) for value in (stream, name, created)):
            return False
        self._created[(stream, name)] = (created, member.name, time.monotonic())
        self._created.move_to_end((stream, name))
        while len(self._created) > self.limit:
            self._created.popitem(last=False)
        return True

    def creator(self, stream: str, entry: dict) -> str | None:
        """The member that created the consumer `entry` (the broker's JSON) of `stream`, if an advisory said so."""
        known = self._created.get((stream, entry.get("name")))
        return known[1] if known is not None and known[0] == entry.get("created") else None

    def forget_absent(self, stream: str, listed: Iterable[str], listed_since: float) -> None:
        """Forget the consumers of `stream` missing from a listing that began at `listed_since` (monotonic)."""
        present = set(listed)
        for key in [key for key, (_, _, noted) in self._created.items()
                    if key[0] == stream and key[1] not in present and noted < listed_since]:
            del self._created[key]

    def __len__(self) -> int:
        return len(self._created)


def owner_or_why_not(config: dict, readers: frozenset[str], inactive_limit_s: float,
                     creator: str | None = None) -> tuple[str | None, str]:
    """(the member the consumer counts against, "") when it may stay, else (None, why it must go). With its
    `creator` known the consumer must push into the creator's own inbox; else into some reader's."""
    deliver = config.get("deliver_subject")
    if not deliver:
        return None, "a pull consumer (hearth's readers push to their inbox)"
    inbox_owner = deliver.split(".")[1] if isinstance(deliver, str) and is_member_inbox(deliver) else None
    if creator is not None and inbox_owner != creator:
        return None, f"{creator} made it deliver to {deliver!r}, not into {creator}'s own inbox"
    if inbox_owner not in readers:
        return None, f"it delivers to {deliver!r}, not the inbox of a member who reads the stream"
    threshold = config.get("inactive_threshold")
    if type(threshold) is not int or not 0 < threshold <= inactive_limit_s * _NANOSECONDS:
        return None, "it has no inactivity limit within the stream's, so it would outlive its member"
    return inbox_owner, ""


def unwanted(consumers: list[dict], readers: frozenset[str], inactive_limit_s: float,
             creator_of: Callable[[dict], str | None] = lambda entry: None) -> dict[str, str]:
    """consumer name -> why it must go, of `consumers` (the broker's JSON, oldest first) on one stream;
    `creator_of` names an entry's creator where known."""
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
        owner, why = owner_or_why_not(config, readers, inactive_limit_s, creator_of(entry))
        if owner is not None:
            held[owner] = held.get(owner, 0) + 1
            if held[owner] > max_consumers_per_member:
                why = f"{owner} holds more than {max_consumers_per_member} consumers of the stream"
        if why:
            verdicts[name] = why
    return verdicts


async def sweep_consumers(nc, roster: Roster, streams: Iterable[str] = SWEPT_STREAMS,
                          creators: ConsumerCreators | None = None) -> list[SweptConsumer]:
    """Delete every unwanted consumer of `streams` (one that does not exist is skipped), judging those whose
    creation `creators` saw by their creator; what was deleted."""
    streams = tuple(streams)
    creators = ConsumerCreators() if creators is None else creators
    readers = stream_readers(roster, streams)
    swept: list[SweptConsumer] = []
    for stream in streams:
        listed_since = time.monotonic()
        consumers = [entry for entry in await listed_consumers(nc, stream) if isinstance(entry, dict)]
        creators.forget_absent(stream, (entry.get("name") for entry in consumers), listed_since)
        consumers.sort(key=lambda entry: str(entry.get("created", "")))
        verdicts = unwanted(consumers, readers[stream], SWEPT_STREAMS.get(stream, 0.0),
                            lambda entry, stream=stream: creators.creator(stream, entry))
        for name, why in verdicts.items():
            if await _delete_consumer(nc, stream, name):
                swept.append(SweptConsumer(stream, name, why))
    return swept


async def _api(nc, subject: str, body: bytes = b"") -> dict:
    reply = await keeping_cancellation(nc.request(subject, body, timeout=api_timeout_s))
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
    """Sweeps every `interval_s`, and at once when the broker audits a consumer's creation, on a thread of its own
    (the broker's process has no event loop), connected as the steward (`system_key`); `report` hears of each
    consumer deleted. Failures are logged and tried at the next sweep."""

    def __init__(self, settings: NatsSettings, system_key: Path, roster_path: Path, *,
                 report: Callable[[SweptConsumer], None], interval_s: float = sweep_interval_s) -> None:
        self.settings = settings.model_copy(update={"creds_file": system_key})
        self.roster_file = RosterFile(roster_path)
        self.report = report
        self.interval_s = interval_s
        self.creators = ConsumerCreators()
        # Set once the broker's audit of consumer creations is subscribed to: from then on every consumer's creator
        # is known, and a broker is ready for members only after it (`hearth nats` waits for it).
        self.watching = threading.Event()
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

        async def api_audited(msg) -> None:
            try:
                advisory = json.loads(msg.data)
            except ValueError:
                return
            if self.creators.record(advisory, self.roster_file.current):
                created.set()

        try:
            while not self._stop.is_set():
                try:
                    if connection is not None and not connection.is_closed and self._key_retired(connection):
                        # nats-py would log in again with the retired seed for ever: the file holds the new one.
                        log.info("consumer sweep: the steward's key was rotated; logging in with the new one")
                        await close_quietly(connection, self.settings.close_timeout_s)
                    if connection is None or connection.is_closed:
                        # A stop landing as it connects is kept, and the connection it made closed.
                        connection = await connected_keeping_cancellation(
                            connect_nats(self.settings.url, name="hearth consumer sweep", settings=self.settings),
                            self.settings.close_timeout_s)
                        await connection.subscribe(API_AUDIT_ADVISORIES, cb=api_audited)
                        # Ordered: nats-py's own flush can be answered before the SUB reaches the broker.
                        await keeping_cancellation(flush_ordered(connection, api_timeout_s))
                        self.watching.set()
                    created.clear()
                    for swept in await sweep_consumers(connection, self.roster_file.current(),
                                                       creators=self.creators):
                        self.report(swept)
                except Exception as error:  # the broker restarting, JetStream without a leader yet: next time
                    log.warning("consumer sweep failed (%s); trying again in %g s", error, self.interval_s)
                await self._wait_for_next_sweep(created)
        finally:
            if connection is not None:
                await close_quietly(connection, self.settings.close_timeout_s)

    def _key_retired(self, connection) -> bool:
        """Whether `connection` logged in with a steward key the roster no longer holds (`rotate-key system`)."""
        identity = connection_identity(connection)
        steward = self.roster_file.current().by_name(SYSTEM_MEMBER)
        return identity is not None and steward is not None and identity.key.public_key != steward.public_key

    async def _wait_for_next_sweep(self, created: asyncio.Event) -> None:
        """Until a consumer is created, `interval_s` passed or a stop was asked for."""
        deadline = asyncio.get_running_loop().time() + self.interval_s
        while not self._stop.is_set() and not created.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            await event_within(created, min(left, stop_poll_s))
