"""Selects messages from the event log for hearth-replay: streams, subject and type filters, time windows, merging.

Reading is always through `events.consume.read_stream`, so no durable consumer is ever created.
Several streams are merged by the time the server stored each message (each stream is already in
that order); with `follow` they are interleaved as they arrive instead, since a quiet stream would
otherwise hold the other one back.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import nats.js.errors

from hearth.events.cancellation import keeping_cancellation
from hearth.events.consume import SkippedMessage, StoredEvent, first_stream_seq, read_stream
from hearth.events.models import EVENT_TYPES
from hearth.events.streams import ALL_STREAMS, MEMBER_REMOVAL_SUBJECTS, STREAM_SPECS
from hearth.protocol.subjects import EVENTS_PREFIX, event_type_filter

LogItem = StoredEvent | SkippedMessage

_duration_part_re = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_duration_units_s = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_EVENT_FAMILIES = sorted({event_type.split(".", 1)[0] for event_type in EVENT_TYPES})
# Types and families published on subjects of their own rather than under their family's (event_subject): a member's
# removal, key rotation or addition goes on one subject in each stream.
_OWN_SUBJECTS: dict[str, tuple[str, ...]] = {
    name: tuple(MEMBER_REMOVAL_SUBJECTS.values())
    for name in ("member.removed", "member.key_rotated", "member.added", "member")}


class QueryError(ValueError):
    """A replay option that cannot be turned into a query (bad duration, unknown type, ...)."""


def parse_duration(text: str) -> timedelta:
    """`90s`, `15m`, `2h`, `1d`, `1h30m` → a timedelta."""
    compact = text.strip().lower().replace(" ", "")
    parts = _duration_part_re.findall(compact)
    if not compact or "".join(number + unit for number, unit in parts) != compact:
        raise QueryError(f"duration {text!r} must look like 90s, 15m, 2h, 1d or 1h30m")
    try:
        return timedelta(seconds=sum(float(number) * _duration_units_s[unit] for number, unit in parts))
    except OverflowError:
        raise QueryError(f"duration {text!r} is longer than any calendar holds") from None


def parse_since(text: str, now: datetime) -> datetime:
    """The instant a duration (`--since 15m`, as parse_duration reads it) before `now`."""
    duration = parse_duration(text)
    try:
        return now - duration
    except OverflowError:
        raise QueryError(f"duration {text!r} reaches back before the calendar's first day") from None


def parse_timestamp(text: str) -> datetime:
    """An RFC 3339 / ISO 8601 time (`2026-11-21T12:00:00Z`); a time without offset is taken as UTC."""
    try:
        value = datetime.fromisoformat(text.strip().replace("z", "Z").replace("Z", "+00:00"))
    except ValueError as error:
        raise QueryError(f"time {text!r} is not RFC 3339 (e.g. 2026-11-21T12:00:00Z)") from error
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:  # an offset that moves it past the calendar's first or last day
        raise QueryError(f"time {text!r} is outside the dates UTC can hold") from None


def check_subject_filter(subject: str) -> str:
    """`subject` if NATS can filter by it: dot-separated tokens, none empty, no whitespace or control character,
    `>` only as the last token; QueryError (before any request) otherwise."""
    tokens = _tokens(subject)
    if any(not token for token in tokens):
        problem = "has an empty token"
    elif not all(character.isprintable() and not character.isspace() for character in subject):
        problem = "holds whitespace or a control character"
    elif ">" in tokens[:-1]:
        problem = "has `>` before its last token"
    else:
        return subject
    raise QueryError(f"subject filter {subject!r} {problem}; e.g. 'hearth.events.shard.*.*.withdrawn'")


def subjects_for_type(event_type: str) -> tuple[str, ...]:
    """The subject filters that select one event type (`pipeline.completed`) or family (`shard`): one, but a
    removal's (`member.removed`), which is on one subject in each stream."""
    if event_type in _OWN_SUBJECTS:
        return _OWN_SUBJECTS[event_type]
    if event_type in EVENT_TYPES:
        return (event_type_filter(event_type),)
    if event_type in _EVENT_FAMILIES:
        return (f"{EVENTS_PREFIX}.{event_type}.>",)
    known = ", ".join(sorted(EVENT_TYPES) + _EVENT_FAMILIES)
    raise QueryError(f"unknown event type {event_type!r}; known: {known}")


def type_matches(event_type: str, wanted: Sequence[str]) -> bool:
    return not wanted or any(event_type == w or event_type.split(".", 1)[0] == w for w in wanted)


def _tokens(subject: str) -> list[str]:
    return subject.split(".")


def subject_is_subset(narrow: str, wide: str) -> bool:
    """Whether every subject matching `narrow` also matches `wide` (both may hold `*` and `>`)."""
    narrow_tokens, wide_tokens = _tokens(narrow), _tokens(wide)
    for index, wide_token in enumerate(wide_tokens):
        if wide_token == ">":
            return index < len(narrow_tokens)
        if index >= len(narrow_tokens):
            return False
        narrow_token = narrow_tokens[index]
        if narrow_token == ">":
            return False
        if wide_token == "*":
            continue
        if narrow_token == "*" or narrow_token != wide_token:
            return False
    return len(narrow_tokens) == len(wide_tokens)


def subjects_collide(a: str, b: str) -> bool:
    """Whether some subject matches both filters."""
    a_tokens, b_tokens = _tokens(a), _tokens(b)
    for index in range(max(len(a_tokens), len(b_tokens))):
        if index >= len(a_tokens) or index >= len(b_tokens):
            return False
        left, right = a_tokens[index], b_tokens[index]
        if left == ">" or right == ">":
            return True
        if left != right and "*" not in (left, right):
            return False
    return True


@dataclass(frozen=True)
class StreamSelection:
    """One stream to read and the server-side filters for it (empty: the whole stream)."""

    stream: str
    filters: tuple[str, ...] = ()


def select_streams(
    streams: Sequence[str] | None = None,
    subject: str | None = None,
    types: Sequence[str] = (),
) -> list[StreamSelection]:
    """The streams (default: both) a subject filter and/or type filters can match, with per-stream filters."""
    chosen = list(streams) if streams else list(ALL_STREAMS)
    specs = {spec.name: spec for spec in STREAM_SPECS}
    for name in chosen:
        if name not in specs:
            raise QueryError(f"unknown stream {name!r}; hearth streams are {', '.join(ALL_STREAMS)}")
    wanted_filters = [check_subject_filter(subject)] if subject else [each for t in types for each in
                                                                       subjects_for_type(t)]
    selections: list[StreamSelection] = []
    for name in chosen:
        stream_subjects = specs[name].subjects
        if not wanted_filters:
            selections.append(StreamSelection(name))
            continue
        filters = [w for w in wanted_filters if any(subjects_collide(w, ss) for ss in stream_subjects)]
        if not filters:
            continue  # nothing in this stream can match
        covers_stream = all(any(subject_is_subset(ss, w) for w in filters) for ss in stream_subjects)
        selections.append(StreamSelection(name, () if covers_stream else tuple(dict.fromkeys(filters))))
    return selections


@dataclass(frozen=True)
class LogQuery:
    """What `hearth-replay events` asked for."""

    selections: list[StreamSelection]
    types: tuple[str, ...] = ()
    from_seq: int = first_stream_seq
    to_seq: int | None = None
    from_time: datetime | None = None
    follow: bool = False
    limit: int | None = None
    include_skipped: bool = True


async def existing_streams(js, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split `names` into streams that exist and streams that do not (nothing published yet)."""
    present, missing = [], []
    for name in names:
        try:
            await keeping_cancellation(js.stream_info(name))
            present.append(name)
        except nats.js.errors.NotFoundError:
            missing.append(name)
    return present, missing


def _read(js, selection: StreamSelection, query: LogQuery) -> AsyncIterator[LogItem]:
    return read_stream(
        js,
        selection.stream,
        from_seq=query.from_seq,
        to_seq=query.to_seq,
        subject_filter=list(selection.filters) or None,
        follow=query.follow,
        from_time=query.from_time,
    )


async def read_log(js, query: LogQuery) -> AsyncIterator[LogItem]:
    """The messages `query` selects: type-filtered, merged across streams, at most `limit` of them."""
    emitted = 0
    if query.limit is not None and query.limit <= 0:
        return
    source = _merge_by_time if not query.follow else _interleave_as_arriving
    async with contextlib.aclosing(source(js, query)) as items:
        async for item in items:
            if isinstance(item, SkippedMessage):
                if not query.include_skipped or query.types:
                    continue
            elif not type_matches(item.event.type, query.types):
                continue
            yield item
            emitted += 1
            if query.limit is not None and emitted >= query.limit:
                return


def _order_key(item: LogItem, stream_index: int) -> tuple:
    return (item.time, stream_index, item.seq)


async def _merge_by_time(js, query: LogQuery) -> AsyncIterator[LogItem]:
    readers = [_read(js, selection, query) for selection in query.selections]
    try:
        heads: dict[int, LogItem] = {}
        for index, reader in enumerate(readers):
            head = await anext(reader, None)
            if head is not None:
                heads[index] = head
        while heads:
            index = min(heads, key=lambda i: _order_key(heads[i], i))
            yield heads[index]
            following = await anext(readers[index], None)
            if following is None:
                del heads[index]
            else:
                heads[index] = following
    finally:
        for reader in readers:
            await reader.aclose()


async def _interleave_as_arriving(js, query: LogQuery) -> AsyncIterator[LogItem]:
    queue: asyncio.Queue[LogItem | BaseException | None] = asyncio.Queue(maxsize=1000)

    async def pump(selection: StreamSelection) -> None:
        try:
            async with contextlib.aclosing(_read(js, selection, query)) as reader:
                async for item in reader:
                    await queue.put(item)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the consumer, which re-raises it
            await queue.put(error)

    tasks = [asyncio.create_task(pump(selection)) for selection in query.selections]
    running = len(tasks)
    try:
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
