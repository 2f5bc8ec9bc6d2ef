"""Who signs what a process left in its outbox file: the member key that made each event, never the process that
writes it after a restart; what another key (or none) signed is dropped (hearth/events/outbox.py, outbox_file.py)."""

from __future__ import annotations

import asyncio
import logging

from hearth.events.models import ShardWithdrawn, decode_event
from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFile
from hearth.events.signing import canonical_bytes
from hearth.trust.keys import MemberKey, verify_b64
from tests.outbox_brokers import BrokerStoringNothing, RecordingBroker

MAKER, RESTARTED = MemberKey.generate(), MemberKey.generate()


class _Restarted(EventOutbox):
    async def _stored_already(self, event) -> bool:
        return False


def withdrawn(shard_id: str) -> ShardWithdrawn:
    return ShardWithdrawn(node_id="n", shard_id=shard_id, reason="shutdown")


async def claim(folder) -> OutboxFile:
    return await asyncio.to_thread(OutboxFile.claim, folder, "orch")


async def leave(folder, events, signing_key: MemberKey | None) -> None:
    """A process that records `events` and ends before the broker stored any of them."""
    ended = EventOutbox(BrokerStoringNothing(), max_queued=8, retry_wait_s=0.01, signing_key=signing_key)
    ended.start(await claim(folder))
    for event in events:
        await ended.record(event)
    await ended.stop(timeout_s=0.05)


async def restart(folder, signing_key: MemberKey | None, *also) -> list:
    """The next process, another member's key, writing what was left (and `also`, its own); the events stored."""
    broker = RecordingBroker()
    restarted = _Restarted(broker, max_queued=8, retry_wait_s=0.01, signing_key=signing_key)
    restarted.start(await claim(folder))
    for event in also:
        await restarted.record(event)
    assert await restarted.flush(timeout_s=5)
    await restarted.stop(timeout_s=1)
    return [decode_event(payload) for payload in broker.payloads]


def signed_by(event, key: MemberKey) -> bool:
    return event.signer == key.public_key and verify_b64(key.public_key, canonical_bytes(event), event.signature)


async def test_what_a_member_left_goes_out_as_it_signed_it_when_it_restarts_with_the_same_key(tmp_path):
    left = [withdrawn("s1"), withdrawn("s2")]
    await leave(tmp_path, left, MAKER)
    own = withdrawn("s-own")
    stored = await restart(tmp_path, MAKER, own)
    assert [event.event_id for event in stored] == [event.event_id for event in [*left, own]]
    assert all(signed_by(event, MAKER) for event in stored)


async def test_what_a_key_the_restarted_process_does_not_hold_left_is_dropped_never_signed_again(tmp_path, caplog):
    """The member's key was rotated meanwhile: stored now, after the old key's cut, the events would be rejected
    `removed_signer` (an audit after an ordinary rotation would fail), and signing them again with the new key would
    vouch for whatever the retired key signed."""
    await leave(tmp_path, [withdrawn("s1"), withdrawn("s2")], MAKER)
    own = withdrawn("s-own")
    with caplog.at_level(logging.WARNING, logger="hearth.events.outbox"):
        stored = await restart(tmp_path, RESTARTED, own)
    assert [event.event_id for event in stored] == [own.event_id]
    assert signed_by(stored[0], RESTARTED)
    assert "2 event(s) a previous run left signed by a key this process does not hold dropped (shard.withdrawn)" \
        in caplog.text
    assert await restart(tmp_path, MAKER) == []  # removed from the file, not only skipped


async def test_what_was_left_unsigned_is_not_signed_by_a_process_that_signs_but_dropped_and_counted(tmp_path, caplog):
    """An event left unsigned (made on an open mesh, or by a version that signed only when writing) has no maker's
    signature to carry: signing it would put it under the restarted member's name."""
    await leave(tmp_path, [withdrawn("s1"), withdrawn("s2")], None)
    own = withdrawn("s-own")
    with caplog.at_level(logging.ERROR, logger="hearth.events.outbox"):
        stored = await restart(tmp_path, RESTARTED, own)
    assert [event.event_id for event in stored] == [own.event_id]
    assert "2 event(s) a previous run left unsigned" in caplog.text
    # On an open mesh (no key) what was left unsigned goes out as it was made.
    await leave(tmp_path, [withdrawn("s3")], None)
    assert [(event.shard_id, event.signature) for event in await restart(tmp_path, None)] == [("s3", None)]
