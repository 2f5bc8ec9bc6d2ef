"""Events within their own bounds that the read models once failed on, and so retried forever: a reason holding a
lone surrogate (no database encodes it), and counts summed over many events past SQLite's 64-bit INTEGER. Both are now
rows like any other; and a body nested past the parser's depth is no signed event."""

from __future__ import annotations

import json

from sqlalchemy import update
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent, decode_stored_message
from hearth.events.models import IntegrityShardsVerified, PipelineAborted, ShardVerification, encode_event
from hearth.events.signing import stored_canonical_bytes
from hearth.events.streams import PIPELINES_STREAM
from hearth.readmodels.batch_rows import max_summed_count
from hearth.readmodels.tables import Pipeline, ShardReputation
from tests.readmodel_helpers import T0, LogBuilder, apply_all, migrated_engine


def test_a_reason_with_a_lone_surrogate_is_stored_with_it_replaced(tmp_path):
    body = json.loads(encode_event(PipelineAborted(pipeline_id="p1", code="x", reason="r", node_id="hub")))
    data = json.dumps({**body, "reason": "cut \ud800 here"}).encode()  # JSON's escape for a lone surrogate
    message = decode_stored_message(PIPELINES_STREAM, 1, "hearth.events.pipeline.p1.aborted", T0, {}, data)
    assert isinstance(message, StoredEvent) and message.event.reason == "cut ? here"
    engine = migrated_engine(tmp_path / "rm.db")
    assert apply_all(engine, [message]) == 1  # before: UnicodeEncodeError at the flush, the batch rolled back
    with Session(engine) as session:
        assert session.get(Pipeline, "p1").status == "aborted"
    engine.dispose()


def test_summed_counts_stop_at_the_bound_instead_of_overflowing(tmp_path):
    log = LogBuilder()
    engine = migrated_engine(tmp_path / "rm.db")
    shard_id = "m:0-3@n"

    def verified(checks: int):
        return log.stored(IntegrityShardsVerified(pipeline_id="p1", node_id="hub", shards=[
            ShardVerification(shard_id=shard_id, checks=checks, verified_positions=checks)]))

    apply_all(engine, [verified(1)])
    with Session(engine) as session, session.begin():  # as after some 2**22 events of 2**40 checks each
        session.execute(update(ShardReputation).values(checks=max_summed_count - 5,
                                                       verified_positions=max_summed_count - 5))
    assert apply_all(engine, [verified(2**40), verified(2**40)]) == 2
    with Session(engine) as session:
        row = session.get(ShardReputation, shard_id)
        assert (row.checks, row.verified_positions) == (max_summed_count, max_summed_count)
    engine.dispose()


def test_a_body_nested_past_the_parsers_depth_has_no_canonical_bytes():
    assert stored_canonical_bytes(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") is None
