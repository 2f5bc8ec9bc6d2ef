"""A call's verification outcome (`met`, `unmet`, none at verify=none) where operators and users look: the pipelines
read model (and a rebuild of it), hearth-replay's pipeline view, the Pipelines dashboard and `hearth chat`."""

from __future__ import annotations

from sqlalchemy.orm import Session

from hearth.events.models import PipelineCompleted
from hearth.readmodels.rebuild import diff_databases
from hearth.readmodels.tables import Pipeline
from hearth.services.replay.reports import PipelineEnd, pipeline_end, pipeline_outcome
from tests.readmodel_helpers import LogBuilder, apply_all, at, constructed, migrated_engine

OUTCOMES = {"p-met": "met", "p-unmet": "unmet", "p-unchecked": None}


def completed(pipeline_id: str, verification: str | None, *, t: float = 3.0) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id=pipeline_id, prompt_tokens=3, completion_tokens=4, duration_ms=50.0,
                             tokens_per_second=80.0, finish_reason="stop", node_id="hub", occurred_at=at(t),
                             verification=verification)


def calls_log() -> list:
    log = LogBuilder()
    events = []
    for index, (pipeline_id, verification) in enumerate(OUTCOMES.items()):
        events += [constructed(pipeline_id, ["m:0-7@a"], t=2 + index), completed(pipeline_id, verification,
                                                                                  t=2.5 + index)]
    return [log.stored(event) for event in events]


def test_the_pipelines_row_keeps_the_outcome_and_a_rebuild_gives_the_same_rows(tmp_path):
    messages = calls_log()
    live = migrated_engine(tmp_path / "live.db")
    for message in messages:  # the live projector, one event a batch
        apply_all(live, [message])
    with Session(live) as session:
        assert {pipeline_id: session.get(Pipeline, pipeline_id).verification for pipeline_id in OUTCOMES} == OUTCOMES
    rebuilt = migrated_engine(tmp_path / "rebuilt.db")
    apply_all(rebuilt, messages)  # hearth-replay rebuild: the whole log through the same projection
    live.dispose()
    rebuilt.dispose()
    assert diff_databases(tmp_path / "rebuilt.db", tmp_path / "live.db") == []


def test_replays_pipeline_outcome_names_a_completed_calls_verification():
    log = LogBuilder()
    for verification, outcome in (("unmet", "completed, verification unmet"), ("met", "completed, verification met"),
                                  (None, "completed")):
        events = [log.stored(constructed("p-1", ["m:0-7@a"])), log.stored(completed("p-1", verification))]
        assert pipeline_outcome(events) == outcome
        assert pipeline_end(events) == PipelineEnd("completed", verification)
    assert pipeline_end(events[:1]) == PipelineEnd("running")
