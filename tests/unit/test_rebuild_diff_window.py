"""A rebuild diff compares only what the log can still rebuild: a live read model older than the streams' windows
holds rows no rebuild can make, left out and counted, while a real difference inside the window still shows."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import text

from hearth.events.streams import SHARDS_STREAM, pipelines_max_age_s, shards_max_age_s
from hearth.readmodels.log_window import OLDER_THAN_LOG_RULES, window_start
from hearth.readmodels.rebuild import diff_databases, diff_within_log
from hearth.readmodels.tables import Base, ProjectionPosition
from tests.readmodel_helpers import LogBuilder, apply_all, migrated_engine
from tests.unit.test_readmodel_retention import forty_days_of_traffic, projection, prune


def live_and_rebuilt(tmp_path) -> tuple:
    """A live read model that projected forty days as they came, and a rebuild from what the streams keep at the end
    (each drops what is older than its max age); returns both paths and the rebuild's window."""
    log = LogBuilder()
    messages = [log.stored(event) for event in forty_days_of_traffic()]
    live, rebuilt = tmp_path / "live.db", tmp_path / "rebuilt.db"
    engine = migrated_engine(live)
    for start in range(0, len(messages), 7):
        apply_all(engine, messages[start:start + 7], projection())
        prune(engine)
    engine.dispose()
    last = {message.stream: message.time for message in messages}
    max_age = {SHARDS_STREAM: shards_max_age_s}
    kept = [m for m in messages if m.time >= last[m.stream] - timedelta(seconds=max_age.get(m.stream,
                                                                                             pipelines_max_age_s))]
    engine = migrated_engine(rebuilt)
    apply_all(engine, kept, projection())
    prune(engine)
    engine.dispose()
    window = {}
    for stream in last:
        first = min((m for m in kept if m.stream == stream), key=lambda m: m.seq)
        window[stream] = window_start(first, max(m.seq for m in messages if m.stream == stream))
    return rebuilt, live, window


def test_rows_older_than_the_log_are_left_out_and_counted_not_reported(tmp_path):
    rebuilt, live, window = live_and_rebuilt(tmp_path)
    assert diff_databases(rebuilt, live) != []  # the false alarm: rows the log dropped the events of
    compared = diff_within_log(rebuilt, live, window)
    assert [str(difference) for difference in compared.differences] == []
    assert compared.left_out_live > compared.left_out_new > 0
    assert compared.window_lines("rebuilt.db", "live.db")[-1] == (
        f"left out as older than the log: {compared.left_out_new} rows of rebuilt.db, "
        f"{compared.left_out_live} rows of live.db")


def test_a_difference_inside_the_window_still_shows(tmp_path):
    rebuilt, live, window = live_and_rebuilt(tmp_path)
    engine = migrated_engine(live)
    with engine.begin() as connection:
        connection.execute(text("UPDATE pipelines SET status = 'aborted' WHERE pipeline_id = "
                                "(SELECT pipeline_id FROM pipelines ORDER BY constructed_at DESC LIMIT 1)"))
    engine.dispose()
    differences = diff_within_log(rebuilt, live, window).differences
    assert [(d.table, d.kind, d.columns) for d in differences] == [("pipelines", "changed", ("status",))]


def test_a_stream_that_kept_its_first_message_leaves_nothing_out():
    log = LogBuilder()
    first, second = (log.stored(event) for event in forty_days_of_traffic()[:2])
    assert window_start(first, last_seq=10) is None
    assert window_start(second, last_seq=10) == int(second.time.timestamp()) + 1
    assert window_start(None, last_seq=0) is None  # a stream nothing was published to
    assert window_start(None, last_seq=10) > int(second.time.timestamp())  # everything aged out


def test_every_table_of_the_log_says_which_of_its_rows_are_older_than_it():
    covered = {rule.table for rule in OLDER_THAN_LOG_RULES}
    assert covered == {table.name for table in Base.metadata.sorted_tables} - {ProjectionPosition.__tablename__}
