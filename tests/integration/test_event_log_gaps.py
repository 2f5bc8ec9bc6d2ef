"""The lost-event check of tests/e2e/event_log_checks.py on a real nats-server: it reads a stream's per-subject
trimming as no loss, and still fails on a message removed that no limit explains, naming its sequence."""

from __future__ import annotations

import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from hearth.events.models import ShardHeartbeat, encode_event
from hearth.services.broker.connection import connect_nats
from tests.e2e.event_log_checks import assert_no_gap_unexplained, stream_unexplained_gaps, unexplained_gaps

pytestmark = pytest.mark.integration

scratch_stream = "SCRATCH_GAPS"
scratch_subjects = ("scratch.gaps.trimmed", "scratch.gaps.kept")
scratch_max_msgs_per_subject = 3


@pytest.fixture
async def nc(nats_url):
    client = await connect_nats(nats_url, name="event-log-gaps")
    yield client
    await client.close()


async def add_scratch_stream(nc, **limits) -> None:
    await nc.jetstream().add_stream(StreamConfig(
        name=scratch_stream, subjects=["scratch.gaps.>"], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, discard=DiscardPolicy.OLD, **limits))


async def publish(nc, subject: str) -> int:
    event = ShardHeartbeat(node_id="node-gaps", shard_id="shard-gaps", queue_depth=0, active_streams=0,
                           p95_latency_ms=0.0, tokens_served_total=0)
    return (await nc.jetstream().publish(subject, encode_event(event))).seq


async def test_per_subject_trimming_is_no_loss_and_a_deleted_message_is(nc):
    await add_scratch_stream(nc, max_msgs_per_subject=scratch_max_msgs_per_subject)
    trimmed, kept = scratch_subjects
    first_kept = await publish(nc, kept)
    trimmed_seqs = [await publish(nc, trimmed) for _ in range(5)]
    second_kept = await publish(nc, kept)
    last_trimmed = await publish(nc, trimmed)
    state = (await nc.jetstream().stream_info(scratch_stream)).state
    # The limit removed the trimmed subject's three oldest: interior gaps, the stream's first message still held.
    assert (state.first_seq, state.num_deleted) == (first_kept, 3)
    assert state.last_seq == last_trimmed and second_kept > trimmed_seqs[-1]
    await assert_no_gap_unexplained(nc, scratch_stream)

    # The kept subject holds two, below its limit: removing one of them is a loss the limits cannot explain.
    assert await nc.jetstream().delete_msg(scratch_stream, second_kept)
    assert await stream_unexplained_gaps(nc, scratch_stream) == [second_kept]
    with pytest.raises(AssertionError, match=rf"\[{second_kept}\]"):
        await assert_no_gap_unexplained(nc, scratch_stream)


@pytest.mark.parametrize("limits", [{"max_msgs": 4}, {"max_bytes": 2000}], ids=["max_msgs", "max_bytes"])
async def test_a_stream_wide_limit_moves_the_start_and_leaves_no_gap(nc, limits):
    await add_scratch_stream(nc, **limits)
    seqs = [await publish(nc, scratch_subjects[index % 2]) for index in range(12)]
    state = (await nc.jetstream().stream_info(scratch_stream)).state
    assert state.first_seq > seqs[0] and state.last_seq == seqs[-1]
    assert (state.num_deleted or 0) == 0 and state.messages == state.last_seq - state.first_seq + 1
    assert await stream_unexplained_gaps(nc, scratch_stream) == []


async def test_a_message_deleted_above_every_subjects_trimming_is_named(nc):
    await add_scratch_stream(nc, max_msgs_per_subject=scratch_max_msgs_per_subject)
    trimmed, kept = scratch_subjects
    seqs = [await publish(nc, trimmed) for _ in range(4)] + [await publish(nc, kept) for _ in range(3)]
    assert await nc.jetstream().delete_msg(scratch_stream, seqs[5])
    assert await stream_unexplained_gaps(nc, scratch_stream) == [seqs[5]]


def test_gaps_the_server_does_not_count_as_deleted_are_all_unexplained():
    """A message the server still holds but the read missed: no gap can be vouched for as trimming."""
    retained = [(1, "a"), (4, "b"), (5, "b"), (6, "b")]
    assert unexplained_gaps(retained, first_seq=1, last_seq=6, num_deleted=2, max_msgs_per_subject=3) == []
    assert unexplained_gaps(retained, first_seq=1, last_seq=6, num_deleted=1, max_msgs_per_subject=3) == [2, 3]
    assert unexplained_gaps(retained, first_seq=1, last_seq=6, num_deleted=2, max_msgs_per_subject=-1) == [2, 3]


def test_sequences_the_server_reports_lost_are_unexplained():
    retained = [(1, "a"), (2, "a")]
    assert unexplained_gaps(retained, first_seq=1, last_seq=2, num_deleted=0, max_msgs_per_subject=3,
                            lost=[2]) == [2]
