"""Objects of the community's weights bucket read back, replaced and cleared away: never more bytes than stated (into
memory for a manifest, into a file of the cache for a layer's or a file's object), within a deadline, and an object
checked against the SHA-256 its manifest states before it takes its name in the cache, and one the stream holds fewer
chunks of than its info states refused at once as incomplete; a manifest replaced only from the state its publisher
read (put_object_if_unchanged); unused objects deleted by key, or purged with nothing left of them, and chunks no
object names (a publisher killed while storing them) purged once old.

Why read here and not by nats-py's ObjectStore.get: it takes chunks until the stream says none are pending, whatever
size the object's info states (a publisher writes that info itself), follows a link to another object into memory,
and keeps its chunk subscription running when a write fails or the read is given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from hearth.events.cancellation import keeping_cancellation
from hearth.services.broker.permissions import WEIGHTS_BUCKET, WEIGHTS_STREAM

log = logging.getLogger(__name__)

# A fetch of an object gets this long plus its size at this rate (a JetStream consumer waits without a deadline)...
OBJECT_FETCH_BASE_TIMEOUT_S = 30.0
OBJECT_FETCH_MIN_BYTES_PER_S = 1 << 20
# ... and gives up sooner when no chunk comes for this long (the broker sends heartbeats every 5 s meanwhile).
OBJECT_CHUNK_IDLE_S = 30.0
# JetStream's answer to a publish whose Nats-Expected-Last-Subject-Sequence no longer holds.
WRONG_LAST_SEQUENCE_ERR_CODE = 10071


class StoredObject(Protocol):
    """What a manifest states of one object (weights_store.StoredObject)."""

    file: str
    size: int
    sha256: str


class WeightsStoreError(Exception):
    """A store model that cannot be published or fetched; the message is one line naming what and why."""


class ObjectMissing(WeightsStoreError):
    """An object its manifest names is not in the bucket: deleted by the publication that replaced it, or never
    stored."""


class ObjectIncomplete(WeightsStoreError):
    """An object's info names more chunks than the bucket holds: chunks purged or lost since it was stored."""


class _BoundedWriter:
    """Hands an object's chunks to `sink` as they are read, refusing any past `limit` bytes."""

    def __init__(self, sink, limit: int, what: str) -> None:
        self.sink, self.limit, self.what = sink, limit, what
        self.written = 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.written > self.limit:
            raise WeightsStoreError(f"{self.what} holds more than the {self.limit} bytes stated for it")
        return self.sink.write(data)


async def _checked_info(js, key: str, what: str, max_bytes: int):
    """Object `key`'s info as its meta message states it; nats-py's ObjectNotFoundError when absent or deleted."""
    from nats.js.api import ObjectInfo
    from nats.js.errors import NotFoundError, ObjectNotFoundError

    try:
        message = await keeping_cancellation(js.get_last_msg(WEIGHTS_STREAM, _meta_subject(key)))
    except NotFoundError:
        raise ObjectNotFoundError from None
    try:
        info = ObjectInfo.from_response(json.loads(message.data))
    except (ValueError, TypeError, KeyError, AttributeError):
        raise WeightsStoreError(f"{what} has unreadable object info") from None
    if info.deleted:
        raise ObjectNotFoundError
    if info.is_link():
        raise WeightsStoreError(f"{what} is a link to another object, which no stored model holds")
    if not isinstance(info.size, int) or info.size > max_bytes:
        raise WeightsStoreError(f"{what} is {info.size} bytes, over {max_bytes}")
    return info


async def _read_chunks(js, key: str, info, what: str, write: Callable[[bytes], Awaitable[None]]):
    """Hand each chunk of object `key`, as `info` describes it, to `write`, in order; the SHA-256 of what was read.
    A chunk that does not come within OBJECT_CHUNK_IDLE_S ends the read: ObjectMissing when the object was deleted
    or replaced meanwhile (its chunks purged), WeightsStoreError otherwise.

    Read here rather than by nats-py's ObjectStore.get, which leaves its chunk subscription (and the heartbeat and
    flow-control tasks that go with it) running when a write fails or the read is given up: on a long-lived
    connection every failed fetch would keep a consumer pushing chunks into memory nobody reads."""
    from nats.errors import Error as NatsError
    from nats.errors import TimeoutError as NatsTimeoutError

    digest = hashlib.sha256()
    if info.size == 0:
        return digest
    if not info.nuid:
        raise WeightsStoreError(f"{what} names no chunks")
    await _check_chunks_stored(js, key, info, what)
    sub = await js.subscribe(_chunk_subject(info.nuid), stream=WEIGHTS_STREAM, ordered_consumer=True)
    try:
        while True:
            try:  # the caller bounds the whole read; this, a stall (nothing left to come, or a broker gone quiet)
                # keeping_cancellation: next_msg's own wait_for could drop the caller's timeout (or a stop) on 3.11.
                message = await keeping_cancellation(sub.next_msg(timeout=OBJECT_CHUNK_IDLE_S))
            except NatsTimeoutError:
                if (await stored_meta(js, key)).chunks_nuid != info.nuid:
                    raise ObjectMissing(f"{what} was deleted while it was read") from None
                raise WeightsStoreError(f"{what}: no chunk of it arrived for {OBJECT_CHUNK_IDLE_S:.0f} s") from None
            await write(message.data)
            digest.update(message.data)
            if message.metadata.num_pending == 0:
                return digest
    finally:
        with contextlib.suppress(NatsError):  # a closed connection has dropped it already
            await sub.unsubscribe()


async def _check_chunks_stored(js, key: str, info, what: str) -> None:
    """ObjectIncomplete when the stream holds fewer chunks of object `key` than its info states (chunks purged or
    lost since it was stored), ObjectMissing when the object was replaced or deleted meanwhile: said at once, where
    reading would end in a digest mismatch or wait out OBJECT_CHUNK_IDLE_S for chunks that never come."""
    subject = _chunk_subject(info.nuid)
    state = (await keeping_cancellation(js.stream_info(WEIGHTS_STREAM, subjects_filter=subject))).state
    stored = (state.subjects or {}).get(subject, 0)
    if not isinstance(info.chunks, int) or stored >= info.chunks:
        return
    if (await stored_meta(js, key)).chunks_nuid != info.nuid:
        raise ObjectMissing(f"{what} was deleted while it was read")
    raise ObjectIncomplete(f"{what} is incomplete in the store ({stored} of its {info.chunks} chunks): publish it "
                           "again")


async def read_small_object(js, key: str, what: str, max_bytes: int) -> bytes:
    """Object `key` of the weights bucket in memory (`what` names it in errors): at most `max_bytes`, no more than
    its info states and matching the SHA-256 that info states, within object_fetch_timeout_s of that size.
    nats-py's ObjectNotFoundError when it is absent."""
    info = await _checked_info(js, key, what, max_bytes)
    buffer = io.BytesIO()
    bounded = _BoundedWriter(buffer, info.size, what)

    async def write(data: bytes) -> None:
        bounded.write(data)

    try:
        async with asyncio.timeout(object_fetch_timeout_s(info.size)):
            digest = await _read_chunks(js, key, info, what, write)
    except TimeoutError:
        raise WeightsStoreError(f"{what} did not arrive within {object_fetch_timeout_s(info.size):.0f} s") from None
    data = buffer.getvalue()
    if len(data) != info.size or _info_digest(info) != digest.digest():
        raise WeightsStoreError(f"{what} arrived corrupted")
    return data


def _info_digest(info) -> bytes | None:
    import base64

    stated = (info.digest or "").removeprefix("SHA-256=").removeprefix("sha-256=")
    try:
        return base64.urlsafe_b64decode(stated)
    except ValueError:
        return None


def object_intact(file: Path, stored: StoredObject) -> bool:
    """Whether `file` holds `stored` as its manifest states it (size and SHA-256)."""
    from hearth.inference.checksum import file_sha256

    return file.is_file() and file.stat().st_size == stored.size and file_sha256(file) == stored.sha256


def object_fetch_timeout_s(size_bytes: int) -> float:
    """How long fetching an object of `size_bytes` may take before it counts as stalled."""
    return OBJECT_FETCH_BASE_TIMEOUT_S + size_bytes / OBJECT_FETCH_MIN_BYTES_PER_S


async def fetch_object(js, key: str, name: str, stored: StoredObject, objects_dir: Path,
                       progress: Callable[[int], object] = lambda _: None) -> None:
    """Object `key` (model `name`'s `stored`) into `objects_dir` under its file name, once it holds exactly what the
    manifest states (size and SHA-256, checked as it arrives), `progress` told the bytes of each chunk written;
    WeightsStoreError (one line) otherwise, and nothing of it is left behind."""
    from nats.js.errors import ObjectNotFoundError

    from hearth.inference.partial_checkpoint import BEING_WRITTEN_SUFFIX, locked_while_written

    what = f"object {stored.file} of {name!r}"
    with tempfile.NamedTemporaryFile(dir=objects_dir, prefix=f".{stored.file}-", suffix=BEING_WRITTEN_SUFFIX,
                                     delete=False) as partial:
        fetched = Path(partial.name)
    try:
        # Locked until it takes its name: a fetch dying midway leaves it to the cache's cleaning, no other.
        with fetched.open("wb") as out, locked_while_written(fetched):
            bounded = _BoundedWriter(out, stored.size, what)

            async def write(data: bytes) -> None:
                await asyncio.to_thread(bounded.write, data)
                progress(len(data))

            info = await _checked_info(js, key, what, stored.size)
            async with asyncio.timeout(object_fetch_timeout_s(stored.size)):
                digest = await _read_chunks(js, key, info, what, write)
            if bounded.written != stored.size or digest.hexdigest() != stored.sha256:
                raise WeightsStoreError(f"{what} does not match the SHA-256 in its manifest (republished or tampered "
                                        "with): nothing loaded")
            # On disk before it takes its name: a crash must not leave a named object the cache trusts by its size.
            await asyncio.to_thread(_flushed, out)
            os.replace(fetched, objects_dir / stored.file)
    except (asyncio.TimeoutError, TimeoutError):
        raise WeightsStoreError(f"{what} did not arrive within {object_fetch_timeout_s(stored.size):.0f} s") from None
    except (ObjectNotFoundError, ObjectMissing):
        raise ObjectMissing(f"{name!r} lacks its object {stored.file}: publish it again") from None
    except OSError as error:
        raise WeightsStoreError(f"{what} cannot be placed in {objects_dir}: {error.strerror or error}") from None
    finally:
        fetched.unlink(missing_ok=True)


def _flushed(out) -> None:
    out.flush()
    os.fsync(out.fileno())


@dataclass(frozen=True)
class StoredMeta:
    """Object `key`'s meta message in the weights bucket as last stored: its stream sequence (what
    put_object_if_unchanged compares; 0: never stored), the subject token of the chunks it names (None: none, or
    the object is deleted) and when the server stored it (None: never), by the server's clock: unlike the info's
    mtime, which its writer states, no publisher sets it."""

    sequence: int = 0
    chunks_nuid: str | None = None
    stored_at: datetime | None = None


async def stored_meta(js, key: str) -> StoredMeta:
    """What the weights bucket holds of object `key` now (StoredMeta() when it was never stored)."""
    from nats.js.errors import NotFoundError

    try:
        message = await keeping_cancellation(js.get_last_msg(WEIGHTS_STREAM, _meta_subject(key)))
    except NotFoundError:
        return StoredMeta()
    meta = json.loads(message.data)
    return StoredMeta(message.seq, None if meta.get("deleted") else meta.get("nuid") or None, message.time)


async def put_object_if_unchanged(js, key: str, data: bytes, seen: StoredMeta, chunk_bytes: int) -> bool:
    """Store `data` as object `key` of the weights bucket only while its meta message is still the one `seen`
    (stored_meta): False, and nothing of it left, when another writer replaced the object meanwhile; once stored, the
    chunks of the object it replaced are purged.

    nats-py's put has no such condition; this writes what it writes (chunks on a subject of their own, then the meta
    message rolling up the subject: ADR-20's layout) with JetStream's Nats-Expected-Last-Subject-Sequence on the
    meta message, so the server itself refuses a switch from a state the writer did not see."""
    nuid, count = await _stored_chunks(js, data, chunk_bytes)
    if not await _meta_stored(js, key, data, nuid, count, chunk_bytes, seen):
        return False
    if seen.chunks_nuid is not None:  # the replaced object's chunks
        await js.purge_stream(WEIGHTS_STREAM, subject=_chunk_subject(seen.chunks_nuid))
    return True


async def put_new_object(js, key: str, data: bytes, chunk_bytes: int) -> None:
    """Store `data` as object `key` of the weights bucket, a key never stored before (a publication's own);
    WeightsStoreError when another writer stored it first. Stopped midway (an error, or Ctrl-C cancelling the task),
    it leaves none of its chunks: no meta message would name them, so no deletion could ever reach them (nats-py's
    put purges them on an Exception only)."""
    nuid, count = await _stored_chunks(js, data, chunk_bytes)
    try:
        stored = await _meta_stored(js, key, data, nuid, count, chunk_bytes, StoredMeta())
    except BaseException:  # stored or not: the publication owning the key fails with it, so nothing names it
        await _purge_quietly(js, nuid)
        raise
    if not stored:
        raise WeightsStoreError(f"object {key} was stored meanwhile by another publisher: publish again")


async def _stored_chunks(js, data: bytes, chunk_bytes: int) -> tuple[str, int]:
    """Store `data` in chunks of `chunk_bytes` on a subject of their own: its token (as nats-py's put names chunks
    by a NUID) and the number of chunks. None of them is left when it is stopped midway."""
    nuid = secrets.token_hex(11)
    count = 0
    try:
        for start in range(0, len(data), chunk_bytes):  # one chunk copied at a time: a layer's object is large
            await keeping_cancellation(js.publish(_chunk_subject(nuid), data[start:start + chunk_bytes]))
            count += 1
    except BaseException:  # an error, or Ctrl-C cancelling the task
        await _purge_quietly(js, nuid)
        raise
    return nuid, count


async def _meta_stored(js, key: str, data: bytes, nuid: str, count: int, chunk_bytes: int, seen: StoredMeta) -> bool:
    """Store the meta message naming the `count` chunks `nuid` of `data` as object `key`, unless its meta message is
    no longer the one `seen`: False then, its chunks purged."""
    import base64
    from datetime import timezone

    from nats.js.api import Header, ObjectInfo, ObjectMetaOptions
    from nats.js.errors import APIError

    info = ObjectInfo(name=key, bucket=WEIGHTS_BUCKET, nuid=nuid, size=len(data), chunks=count,
                      mtime=datetime.now(timezone.utc).isoformat(),
                      digest="SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode(),
                      options=ObjectMetaOptions(max_chunk_size=chunk_bytes))
    try:
        await keeping_cancellation(js.publish(_meta_subject(key), json.dumps(info.as_dict()).encode(), headers={
            Header.ROLLUP: "sub", Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(seen.sequence)}))
    except APIError as error:  # refused (another error may come after the server stored it: the chunks stay)
        await js.purge_stream(WEIGHTS_STREAM, subject=_chunk_subject(nuid))
        if error.err_code == WRONG_LAST_SEQUENCE_ERR_CODE:
            return False
        raise
    return True


async def _purge_quietly(js, nuid: str) -> None:
    with contextlib.suppress(Exception):  # the error that stopped the writer is the one to tell
        await js.purge_stream(WEIGHTS_STREAM, subject=_chunk_subject(nuid))


def _chunk_subject(nuid: str) -> str:
    return f"$O.{WEIGHTS_BUCKET}.C.{nuid}"


def _meta_subject(key: str) -> str:
    import base64

    return f"$O.{WEIGHTS_BUCKET}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"


async def purge_object(js, key: str) -> None:
    """Remove object `key` from the weights stream with nothing left of it: its chunks, then its meta message
    (nats-py's delete writes a tombstone in its place, which a bucket at its bound may refuse)."""
    meta = await stored_meta(js, key)
    if meta.chunks_nuid is not None:
        await keeping_cancellation(js.purge_stream(WEIGHTS_STREAM, subject=_chunk_subject(meta.chunks_nuid)))
    await keeping_cancellation(js.purge_stream(WEIGHTS_STREAM, subject=_meta_subject(key)))


async def purge_unnamed_chunks(js, named: set[str], stored_before: datetime) -> int:
    """Purge the chunks that no object's meta message names (`named`: the chunk tokens of every meta message, a
    deleted object's too) whose last chunk the server stored before `stored_before`: what a publisher killed while
    storing an object left, which no deletion by key could reach. Younger ones may be a publisher's still at work.
    The number of objects' chunks purged."""
    prefix = _chunk_subject("")
    state = (await keeping_cancellation(js.stream_info(WEIGHTS_STREAM, subjects_filter=_chunk_subject(">")))).state
    purged = 0
    for subject in state.subjects or {}:
        if subject.removeprefix(prefix) in named:
            continue
        last = await keeping_cancellation(js.get_last_msg(WEIGHTS_STREAM, subject))
        if last.time is not None and last.time < stored_before:
            await keeping_cancellation(js.purge_stream(WEIGHTS_STREAM, subject=subject))
            purged += 1
    return purged


async def delete_objects(store, keys: set[str]) -> None:
    """Delete the objects `keys` of `store`; one that cannot be deleted (or is gone already) is logged and left."""
    from nats.errors import Error as NatsError

    for key in sorted(keys):
        try:
            await store.delete(key)
        except NatsError as error:
            log.warning("could not delete the unused object %s: %s", key, error)
