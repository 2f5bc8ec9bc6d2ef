"""A call's verification outcome (`met`, `unmet`, none at verify=none) where operators and users look: the pipelines
read model (and a rebuild of it), hearth-replay's pipeline view, the Pipelines dashboard, `hearth status` and
`hearth chat`."""

from __future__ import annotations

import contextlib
import sqlite3

from alembic import command
from rich.console import Console
from sqlalchemy.orm import Session

from hearth.events.models import PipelineCompleted
from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, Usage
from hearth.readmodels.db import alembic_config, open_engine, upgrade_database
from hearth.readmodels.rebuild import diff_databases
from hearth.readmodels.tables import Pipeline
from hearth.services.client.command import ChatPrinter
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.panels import UNMET_VERIFICATION_SQL
from hearth.services.dashboards.status import RECENT_CALLS_S, run_status_command
from hearth.services.replay.reports import PipelineEnd, pipeline_end, pipeline_outcome
from tests.readmodel_helpers import MODEL_ID, LogBuilder, apply_all, at, constructed, migrated_engine

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


def test_the_unmet_panel_counts_each_hours_unmet_calls_by_model_and_zero_where_all_met(tmp_path):
    hour = 3600
    log, events = LogBuilder(), []
    calls = [  # (when, model, verification)
        (10, MODEL_ID, "unmet"), (20, MODEL_ID, "unmet"), (30, MODEL_ID, "met"), (40, "other/m", "unmet"),
        (50, MODEL_ID, None),  # verify none: not a checked call
        (hour + 10, MODEL_ID, "met"),  # the next hour: checked, none unmet
        (2 * hour + 10, MODEL_ID, None),
    ]
    for index, (t, model, verification) in enumerate(calls):
        pipeline_id = f"p-{index}"
        events += [constructed(pipeline_id, ["m:0-7@a"], t=t).model_copy(update={"model_id": model}),
                   completed(pipeline_id, verification, t=t + 1)]
    # A call whose constructed event aged out of the log: counted by when it ended, under no model.
    events.append(completed("p-aged", "unmet", t=hour + 20))
    engine = migrated_engine(tmp_path / "rm.db")
    apply_all(engine, [log.stored(event) for event in sorted(events, key=lambda event: event.occurred_at)])
    engine.dispose()
    start = int(at(0).timestamp()) // hour * hour
    with contextlib.closing(open_read_only(tmp_path / "rm.db")) as connection:
        columns, rows = run_panel_sql(connection, UNMET_VERIFICATION_SQL, TimeRange(start, start + 3 * hour))
    counted = {(time - start, model): calls for time, model, calls in (
        (row[columns.index("time")], row[columns.index("model")], row[columns.index("unmet_calls")]) for row in rows)}
    assert counted == {(0, MODEL_ID): 2, (0, "other/m"): 1, (hour, MODEL_ID): 0, (hour, ""): 1}


def status_screen(path, now_s: int) -> str:
    console = Console(width=400, record=True)
    assert run_status_command(path, now_s=now_s, console=console) == 0
    return console.export_text()


def test_hearth_status_counts_the_unmet_calls_among_those_checked_in_its_window(tmp_path):
    log, events = LogBuilder(), []
    calls = [(-10, "unmet"), (10, "unmet"), (20, "met"), (30, None), (40, "met"), (50, "met")]  # (when, verification)
    for index, (t, verification) in enumerate(calls):
        events += [constructed(f"p-{index}", ["m:0-7@a"], t=t), completed(f"p-{index}", verification, t=t + 1)]
    path = tmp_path / "rm.db"
    engine = migrated_engine(path)
    apply_all(engine, [log.stored(event) for event in sorted(events, key=lambda event: event.occurred_at)])
    engine.dispose()
    now_s = int(at(0).timestamp()) + RECENT_CALLS_S  # the call at -10 s is before the window
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:  # completed before migration 0020
        connection.execute("UPDATE pipelines SET verification = 'unrecorded' WHERE pipeline_id = 'p-5'")
    rows = calls_rows(status_screen(path, now_s))
    assert rows == {"completed": ["completed", "5", "-", "80", "1 of 3 checked"]}  # hop names: the orchestrator's log
    assert calls_rows(status_screen(path, now_s + 15))["completed"][-1] == "0 of 2 checked"  # the unmet call left it
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE pipelines SET verification = NULL")  # verify none throughout
    assert calls_rows(status_screen(path, now_s))["completed"][-1] == "-"


def calls_rows(screen: str) -> dict[str, list[str]]:
    """The calls table's rows of a status screen, by outcome."""
    calls = screen[screen.index("Calls in the last"):]
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in calls.splitlines() if line.startswith("│")]
    return {row[0]: row for row in cells}


def test_hearth_chat_notes_an_unmet_verification_on_stderr_only(capsys):
    def answer(verification: str | None) -> tuple[str, str]:
        printer = ChatPrinter()
        frames = [TokenDeltaFrame(seq=0, text="Hello", token_id=1),
                  DoneFrame(seq=1, finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1),
                            verification=verification)]
        assert [printer.show(frame) for frame in frames] == [None, None]
        return capsys.readouterr()

    out, err = answer("unmet")
    assert out == "Hello\n" and err.splitlines()[-1].endswith(" ms, verification unmet]")
    for verification in ("met", None):
        out, err = answer(verification)
        assert out == "Hello\n" and "verification" not in err


def test_a_rebuild_diff_leaves_out_the_outcome_of_calls_completed_before_the_upgrade_and_only_that(tmp_path):
    live_path, rebuilt_path = tmp_path / "live.db", tmp_path / "rebuilt.db"
    messages = calls_log()
    live = migrated_engine(live_path)
    apply_all(live, messages[:4])  # p-met and p-unmet completed before the upgrade, p-unchecked after it
    live.dispose()
    command.downgrade(alembic_config(live_path), "0019")  # as the projector of before 0020 left the file
    upgrade_database(live_path)
    live = open_engine(live_path)
    apply_all(live, messages[4:])
    live.dispose()
    rebuilt = migrated_engine(rebuilt_path)
    apply_all(rebuilt, messages)
    rebuilt.dispose()
    with contextlib.closing(sqlite3.connect(live_path)) as connection:
        assert dict(connection.execute("SELECT pipeline_id, verification FROM pipelines")) == {
            "p-met": "unrecorded", "p-unmet": "unrecorded", "p-unchecked": None}
    assert diff_databases(rebuilt_path, live_path) == []
    # A live row that does say its outcome is still compared.
    with contextlib.closing(sqlite3.connect(live_path)) as connection, connection:
        connection.execute("UPDATE pipelines SET verification = 'met' WHERE pipeline_id = 'p-unchecked'")
    assert [(difference.key, difference.columns) for difference in diff_databases(rebuilt_path, live_path)] == [
        ({"pipeline_id": "p-unchecked"}, ("verification",))]
