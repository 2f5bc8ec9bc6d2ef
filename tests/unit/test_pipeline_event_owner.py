"""A pipeline's events count only from the orchestrator that built it (readmodels/admission.py): another
orchestrator of the community reads every pipeline id in the log, and its signed events for one of them would
otherwise rewrite that call's row (its status, hops, owner) and credit its hosts' tokens."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from hearth.events.consume import StoredEvent
from hearth.events.models import PipelineAborted, PipelineCompleted, encode_event
from hearth.events.signing import EventVerifier, sign_event
from hearth.events.streams import PIPELINES_STREAM
from hearth.protocol.subjects import event_subject, shard_id_for
from hearth.readmodels.projection import ReadModelProjection, Rejection
from hearth.readmodels.tables import HostTokensDaily, Pipeline
from hearth.trust.keys import MemberKey
from hearth.trust.roster import new_member, new_roster
from tests.readmodel_helpers import MODEL_ID, at, constructed, migrated_engine

KEYS = {name: MemberKey.generate() for name in ("hub", "hub-b")}


def signed(event, key_name: str, seq: int) -> StoredEvent:
    event = sign_event(event.model_copy(update={"node_id": key_name}), KEYS[key_name])
    return StoredEvent(stream=PIPELINES_STREAM, seq=seq, subject=event_subject(event), time=event.occurred_at,
                       headers={}, event=event, data=encode_event(event))


def test_another_orchestrator_s_events_for_a_pipeline_are_rejected_and_its_own_apply(tmp_path):
    roster = new_roster("test")
    for name in KEYS:
        roster = roster.with_member(new_member(name, "orchestrator", KEYS[name].public_key))
    hops = [shard_id_for(MODEL_ID, 0, 3, "host0")]
    aborted = PipelineAborted(pipeline_id="p-1", code="attack", reason="forged", node_id="x", occurred_at=at(3))

    def done() -> PipelineCompleted:
        return PipelineCompleted(pipeline_id="p-1", prompt_tokens=10**6, completion_tokens=1, duration_ms=5.0,
                                 tokens_per_second=1.0, finish_reason="length", node_id="x", occurred_at=at(3))

    messages = [signed(constructed("p-1", hops), "hub", 1), signed(aborted, "hub-b", 2), signed(done(), "hub-b", 3),
                signed(constructed("p-1", ["x:0-1@elsewhere"], t=3), "hub-b", 4),
                signed(constructed("p-2", hops), "hub-b", 5), signed(done(), "hub", 6)]
    rejections: list[Rejection] = []
    engine = migrated_engine(tmp_path / "rm.db")
    try:
        with Session(engine) as session, session.begin():
            projection = ReadModelProjection(verifier=EventVerifier(roster, max_clock_skew_s=30.0))
            projection.apply_many(session, messages, rejections=rejections)
        assert [(r.seq, r.reason) for r in rejections] == [(2, "node_mismatch"), (3, "node_mismatch"),
                                                           (4, "node_mismatch")]
        with Session(engine) as session:
            rows = {row.pipeline_id: row for row in session.scalars(select(Pipeline))}
            assert (rows["p-1"].orchestrator_node_id, rows["p-1"].status) == ("hub", "completed")
            assert rows["p-1"].hops == f'["{hops[0]}"]'
            assert rows["p-2"].orchestrator_node_id == "hub-b"
            # The tokens of hub's own completion only, once.
            assert [row.tokens for row in session.scalars(select(HostTokensDaily))] == [10**6 + 1]
    finally:
        engine.dispose()
