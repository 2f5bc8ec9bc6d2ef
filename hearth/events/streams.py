"""The two JetStream streams of docs/events.md: `ensure_streams`, which creates or updates them idempotently (the
steward's tooling on a community broker, every process on an open one), and `StreamSetup`, which says how a process
makes sure they exist before it uses them (on a community broker: it waits for the steward's)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamConsumerLimits
from nats.errors import Error as NatsError
from nats.js.errors import APIError, NotFoundError

from hearth.events.cancellation import keeping_cancellation
from hearth.protocol.subjects import (
    EVENTS_PREFIX,
    INTEGRITY_EVENTS_WILDCARD,
    PIPELINE_EVENTS_WILDCARD,
    SHARD_EVENTS_WILDCARD,
)
from hearth.trust.roster import SYSTEM_MEMBER

log = logging.getLogger(__name__)

SHARDS_STREAM = "HEARTH_SHARDS"
PIPELINES_STREAM = "HEARTH_PIPELINES"
ALL_STREAMS: tuple[str, ...] = (SHARDS_STREAM, PIPELINES_STREAM)

seconds_per_day = 24 * 3600
MiB = 1024 * 1024
shards_max_age_s = 7 * seconds_per_day
pipelines_max_age_s = 30 * seconds_per_day
# The largest event the server stores: every event field is bounded (hearth/events/models.py), so even an event with
# every field at its limit, in characters JSON escapes to six bytes, stays below it (tests/unit/test_event_limits.py);
# an honest one is a few hundred bytes. Nothing larger, from a buggy or a forging publisher, is ever stored.
event_max_msg_bytes = 256 * 1024
# Each stream's whole size on disk; beyond it the oldest messages go (discard old), as they do past max_age.
shards_max_bytes = 256 * MiB
pipelines_max_bytes = 1024 * MiB
# Caps heartbeats per shard subject; it applies to every subject of the stream (advertised/withdrawn too),
# which is harmless because those are rare.
shards_max_msgs_per_subject = 1000
# A re-publish with the same Nats-Msg-Id inside this window is dropped by the server.
duplicate_window_s = 120.0
# Every consumer of a stream is deleted by the server once it has been inactive this long (no interest on a push
# consumer's deliver subject, no pull on a pull consumer's), whatever the member who made it asked: the broker checks
# the API subject, not the request's body, so a reader could otherwise make a consumer that outlives it (a durable).
# hearth's own readers ask for less (events/ordered_reader.py).
consumer_inactive_limit_s = 60.0
# The weights store's stream: nats-py's object store leaves each object's consumer behind to expire, so they must
# expire soon (the server's own default for a consumer that names no threshold).
weights_consumer_inactive_limit_s = 5.0
# Consumers a stream holds at once: a community's processes need a few each. The server refuses more, whoever asks;
# the steward's sweep (services/broker/consumer_sweep.py) keeps one member from taking them all.
max_consumers_per_stream = 1024

# Copies of each stream on a cluster (a stream survives losing one node of three with its quorum); a single
# server keeps the one copy it can.
cluster_stream_replicas = 3

# While a member's process waits for the steward's streams, it looks this often.
streams_poll_interval_s = 1.0
stream_info_timeout_s = 5.0
# Who creates the streams on a community broker, for the line a waiting process prints.
STREAMS_CREATED_BY = ("the community's steward creates them: `hearth nats --community DIR` does when it starts, "
                      "`hearth community streams --nats URL` for a broker run otherwise")

# JetStream error codes: "stream name already in use with a different configuration", "replicas > 1 not
# supported in non-clustered mode", "stream configuration update can not change ..." (storage, retention,
# deny_delete), "subjects overlap with an existing stream" and "insufficient storage resources available" (the
# server's max_file_store cannot hold what the stream's max_bytes reserves beside the other streams').
_STREAM_NAME_IN_USE_ERR_CODE = 10058
_REPLICAS_NEED_A_CLUSTER_ERR_CODE = 10074
_STREAM_UPDATE_REFUSED_ERR_CODE = 10052
_SUBJECTS_OVERLAP_ERR_CODE = 10065
NO_ROOM_IN_STORE_ERR_CODE = 10047


@dataclass(frozen=True)
class StreamSpec:
    """What one hearth stream must look like; `config()` renders it for the JetStream API."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int
    max_msg_bytes: int = event_max_msg_bytes
    max_msgs_per_subject: int = -1
    description: str = ""

    def config(self, *, replicas: int = 1) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msg_size=self.max_msg_bytes,
            max_msgs_per_subject=self.max_msgs_per_subject,
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
            allow_direct=True,
            max_consumers=max_consumers_per_stream,
            consumer_limits=consumer_limits(),
        )


def consumer_limits(inactive_limit_s: float = consumer_inactive_limit_s) -> StreamConsumerLimits:
    """The limits the server holds every consumer of a hearth stream to (the weights store's with its own)."""
    return StreamConsumerLimits(inactive_threshold=inactive_limit_s)


SHARDS_STREAM_SPEC = StreamSpec(
    name=SHARDS_STREAM,
    subjects=(SHARD_EVENTS_WILDCARD,),
    max_age_s=shards_max_age_s,
    max_bytes=shards_max_bytes,
    max_msgs_per_subject=shards_max_msgs_per_subject,
    description="hearth shard lifecycle: advertised, heartbeat (capped per subject), withdrawn",
)
PIPELINES_STREAM_SPEC = StreamSpec(
    name=PIPELINES_STREAM,
    subjects=(PIPELINE_EVENTS_WILDCARD, INTEGRITY_EVENTS_WILDCARD),
    max_age_s=pipelines_max_age_s,
    max_bytes=pipelines_max_bytes,
    description="hearth pipeline lifecycle and integrity detections",
)
STREAM_SPECS: tuple[StreamSpec, ...] = (SHARDS_STREAM_SPEC, PIPELINES_STREAM_SPEC)

# Where the steward publishes a `member.removed` on each stream: under the shard family's `system` node on
# HEARTH_SHARDS (no shard host may publish there), as an integrity subject on HEARTH_PIPELINES.
MEMBER_REMOVAL_SUBJECTS: dict[str, str] = {
    SHARDS_STREAM: f"{EVENTS_PREFIX}.shard.{SYSTEM_MEMBER}.members.removed",
    PIPELINES_STREAM: f"{EVENTS_PREFIX}.integrity.members.removed",
}


def stream_for_subject(subject: str) -> str:
    """The stream an event subject belongs to (raises ValueError for a subject outside both)."""
    if subject.startswith("hearth.events.shard."):
        return SHARDS_STREAM
    if subject.startswith(("hearth.events.pipeline.", "hearth.events.integrity.")):
        return PIPELINES_STREAM
    raise ValueError(f"subject {subject!r} belongs to no hearth stream")


async def ensure_streams(js: JetStreamContext, *, replicas: int = cluster_stream_replicas) -> None:
    """Create both streams, or bring an existing one to the current spec; safe when processes race.

    On a cluster each stream gets `replicas` copies (an R1 stream of an earlier single server is scaled up);
    a single server, which refuses more than one, gets one: every process can call this, wherever it runs."""
    for spec in STREAM_SPECS:
        await ensure_stream(js, spec.config, replicas=replicas)


async def ensure_stream(js: JetStreamContext, config: Callable[..., StreamConfig], *,
                        replicas: int = cluster_stream_replicas) -> None:
    """Create the stream `config(replicas=...)` renders, or bring an existing one to it: `replicas` copies on a
    cluster, one on a single server (which refuses more)."""
    try:
        await _ensure_stream(js, config(replicas=replicas))
    except APIError as error:
        if error.err_code != _REPLICAS_NEED_A_CLUSTER_ERR_CODE or replicas == 1:
            raise
        await _ensure_stream(js, config(replicas=1))


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        # An identical add is a no-op on the server, so two processes starting together both succeed.
        await keeping_cancellation(js.add_stream(config))
        log.debug("stream %s ensured", config.name)
        return
    except APIError as error:
        if error.err_code == _SUBJECTS_OVERLAP_ERR_CODE:
            raise StreamsIncompatible(
                f"the event stream {config.name} cannot be created: another stream on the broker already holds its "
                f"subjects ({', '.join(config.subjects or ())}); remove those subjects from it") from None
        if error.err_code == NO_ROOM_IN_STORE_ERR_CODE:
            raise _no_room_in_store(config) from None
        if error.err_code != _STREAM_NAME_IN_USE_ERR_CODE:
            raise
    # It exists with another configuration (an older hearth, or replicas differ): update it in place.
    try:
        await keeping_cancellation(js.update_stream(config))
        log.info("stream %s updated to the current spec", config.name)
    except NotFoundError:
        # Deleted between our add and update: create it.
        await keeping_cancellation(js.add_stream(config))
    except APIError as error:
        if error.err_code == NO_ROOM_IN_STORE_ERR_CODE:
            raise _no_room_in_store(config) from None
        if error.err_code != _STREAM_UPDATE_REFUSED_ERR_CODE:
            raise
        # Made by hand or by other tooling with a setting no update may change: only its owner can decide what to
        # do with what it holds, so it is named, never deleted here.
        raise StreamsIncompatible(
            f"the event stream {config.name} exists with settings the broker will not change to hearth's "
            f"({error.description}); keep a copy of it if you need one and delete it (`nats stream rm "
            f"{config.name}`), then start again") from None


def _no_room_in_store(config: StreamConfig) -> "StreamsIncompatible":
    return StreamsIncompatible(
        f"the stream {config.name} cannot be created: the broker's store has no room for the "
        f"{(config.max_bytes or 0) // MiB} MiB it reserves (`hearth nats` bounds its store to what it holds plus "
        "3/4 of its disk's free space at start); free space on the broker's disk and restart it (docs/operations.md)")


class StreamsMissing(RuntimeError):
    """The event streams a process needs do not exist, and on a community broker it may not create them."""


def streams_missing(missing: Iterable[str], where: str | None = None) -> StreamsMissing:
    """The one line that says which event streams the broker (at `where`) lacks, and who creates them."""
    on = f" on {where}" if where else ""
    return StreamsMissing(f"the event streams {', '.join(missing)} do not exist{on}; {STREAMS_CREATED_BY}")


class StreamsIncompatible(StreamsMissing):
    """A stream exists with settings the broker will not bring to hearth's (storage, retention, deny_delete), or another
    stream holds its subjects: as unusable as a missing one, and not the same to fix."""


class StreamsUnknown(StreamsMissing):
    """The broker did not say whether a stream exists (no answer in time, JetStream off, a permission refused): not
    the same as a stream it says it lacks, and told apart in what a process prints."""


async def missing_streams(js: JetStreamContext, names: Iterable[str]) -> list[str]:
    """Which of `names` the broker says it does not hold; StreamsUnknown when it would not say for one of them within
    stream_info_timeout_s."""
    missing = []
    for name in names:
        try:
            async with asyncio.timeout(stream_info_timeout_s):
                await keeping_cancellation(js.stream_info(name))
        except NotFoundError:
            missing.append(name)
        except (NatsError, asyncio.TimeoutError) as error:
            reason = str(error) or f"no answer within {stream_info_timeout_s:g} s"
            raise StreamsUnknown(f"the broker did not say whether the event stream {name} exists ({reason})") from None
    return missing


async def wait_for_streams(js: JetStreamContext, names: Iterable[str], *, wait_s: float | None) -> None:
    """Return once every stream of `names` exists; StreamsMissing after `wait_s` (None: wait forever)."""
    names = tuple(names)
    deadline = None if wait_s is None else time.monotonic() + wait_s
    told = False
    while missing := await _missing_or_why(js, names):
        message = missing if isinstance(missing, str) else str(streams_missing(missing))
        if deadline is not None and time.monotonic() >= deadline:
            raise StreamsMissing(f"{message} (waited {wait_s:g} s)")
        if not told:
            log.warning("%s; waiting for them", message)
            told = True
        await asyncio.sleep(streams_poll_interval_s)
    if told:
        log.info("the event streams %s exist now", ", ".join(names))


async def _missing_or_why(js: JetStreamContext, names: tuple[str, ...]) -> list[str] | str:
    """The streams of `names` the broker lacks, or why it did not say (a waiting process asks again)."""
    try:
        return await missing_streams(js, names)
    except StreamsUnknown as error:
        return str(error)


@dataclass(frozen=True)
class StreamSetup:
    """How a process makes sure the streams it uses exist: on an open broker it creates them itself (`create`);
    on a community broker only the steward may, so it waits up to `wait_s` for them (None: as long as it takes)."""

    create: bool = True
    wait_s: float | None = None

    async def ready(self, js: JetStreamContext, names: Iterable[str] = ALL_STREAMS) -> None:
        if self.create:
            await ensure_streams(js)
        else:
            await wait_for_streams(js, names, wait_s=self.wait_s)
