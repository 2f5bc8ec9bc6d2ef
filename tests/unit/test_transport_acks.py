"""AckObserver bookkeeping (which hop holds a step) and latency percentiles, without a network."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hearth.services.transport.acks import AckObserver
from hearth.services.transport.headers import AckHeader
from hearth.services.transport.link_auth import LinkAuth
from hearth.services.transport.mac import ack_witness_key, new_link_key
from hearth.services.transport.stats import LatencySamples

PIPELINE = "pipe-obs"


def ack(hop: int, step: int, chunk: int = 0, count: int = 1, session: str = "s1") -> AckHeader:
    return AckHeader(pipeline_id=PIPELINE, hop=hop, session=session, step=step, chunk_index=chunk, chunk_count=count)


def observer(**options) -> AckObserver:
    # record() and the queries never touch the connection; start() is what subscribes.
    return AckObserver(None, PIPELINE, **options)  # type: ignore[arg-type]


def test_holder_is_the_highest_hop_and_chunks_count_at_that_hop_only():
    acks = observer(sink_hop=3)
    acks.record(ack(hop=0, step=4, chunk=0, count=2), now_monotonic=1.0)
    acks.record(ack(hop=0, step=4, chunk=1, count=2), now_monotonic=1.1)
    assert acks.progress("s1", 4).fully_acked and acks.holder("s1", 4) == 0
    acks.record(ack(hop=1, step=4, chunk=1, count=2), now_monotonic=1.2)
    acks.record(ack(hop=1, step=4, chunk=1, count=2), now_monotonic=1.3)  # a re-ack of a duplicate
    acks.record(ack(hop=0, step=4, chunk=0, count=2), now_monotonic=1.4)  # late ack from an earlier hop
    progress = acks.progress("s1", 4)
    assert (progress.hop, progress.chunks_acked, progress.fully_acked) == (1, 1, False)
    assert progress.last_ack_monotonic == 1.3
    assert acks.holder("s1", 5) is None and acks.holder("other", 4) is None


def test_stalled_lists_only_the_newest_unfinished_step_of_each_session_past_the_timeout():
    acks = observer(sink_hop=2)
    acks.record(ack(hop=0, step=1), now_monotonic=10.0)  # overtaken by step 2: not stalled
    acks.record(ack(hop=1, step=2), now_monotonic=10.0)  # held by hop 1
    acks.record(ack(hop=2, step=7, session="done"), now_monotonic=10.0)  # reached the sink
    acks.record(ack(hop=0, step=3, session="fresh"), now_monotonic=14.5)  # too recent

    stalled = acks.stalled(older_than_s=2.0, now_monotonic=15.0)

    assert [(p.session, p.step, p.hop) for p in stalled] == [("s1", 2, 1)]
    assert acks.stalled(older_than_s=10.0, now_monotonic=15.0) == []


def test_memory_is_bounded_per_session_and_in_sessions():
    acks = observer(max_steps_per_session=3, max_sessions=2)
    for step in range(10):
        acks.record(ack(hop=0, step=step))
    assert [step for step in range(10) if acks.progress("s1", step)] == [7, 8, 9]
    acks.record(ack(hop=0, step=0, session="s2"))
    acks.record(ack(hop=0, step=0, session="s3"))
    assert acks.progress("s1", 9) is None and acks.holder("s3", 0) == 0


@pytest.mark.parametrize(("fraction", "expected_ms"), [(0.5, 50.0), (0.95, 95.0), (0.01, 1.0), (1.0, 100.0)])
def test_latency_percentiles_are_nearest_rank(fraction, expected_ms):
    samples = LatencySamples()
    for millis in range(100, 0, -1):
        samples.add(millis / 1000.0)
    assert samples.percentile_ms(fraction) == pytest.approx(expected_ms)
    assert samples.summary().count == 100 and samples.summary().max_ms == pytest.approx(100.0)


async def test_an_ack_counts_only_with_the_witness_of_the_hop_it_names():
    """Hop 0 holds the key of the link into hop 1, so it could MAC an ack in hop 1's name, never pass the step on,
    and get honest hop 1 blamed for holding it; the witness, keyed from hop 1's own notice key, it cannot make."""
    link_into_1 = new_link_key()
    notice_keys = {1: new_link_key(), 2: new_link_key()}
    watched = observer(sink_hop=3, link_keys={1: link_into_1, 2: new_link_key()},
                       ack_witness_keys={hop: ack_witness_key(key) for hop, key in notice_keys.items()})

    async def deliver(auth: LinkAuth) -> None:
        headers = auth.sign_ack(ack(hop=1, step=5).to_nats_headers())
        await watched._on_ack(SimpleNamespace(headers=headers, data=b"", subject="hearth.ack.test"))

    await deliver(LinkAuth(link_into_1, sealed=False))  # hop 0's forgery: the link's MAC, no witness
    await deliver(LinkAuth(link_into_1, sealed=False, ack_witness_key=ack_witness_key(notice_keys[2])))  # another's
    assert watched.progress("s1", 5) is None and watched.bad_acks == 2
    await deliver(LinkAuth(link_into_1, sealed=False, ack_witness_key=ack_witness_key(notice_keys[1])))  # hop 1's own
    assert watched.holder("s1", 5) == 1 and watched.bad_acks == 2
