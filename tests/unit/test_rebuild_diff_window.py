"""A rebuild diff compares only what the log can still rebuild: a live read model older than the streams' windows
holds rows no rebuild can make, left out and counted, while a real difference inside the window still shows."""

from __future__ import annotations

from datetime import timedelta

from alembic import command
from sqlalchemy import text

from hearth.events.consume import StoredEvent
from hearth.events.models import MemberRemoved
from hearth.events.streams import (
    MEMBER_REMOVAL_SUBJECTS,
    PIPELINES_STREAM,
    SHARDS_STREAM,
    pipelines_max_age_s,
    seconds_per_day,
    shards_max_age_s,
)
from hearth.readmodels.db import alembic_config, open_engine, upgrade_database
from hearth.readmodels.log_window import OLDER_THAN_LOG_RULES, keys_older_than_log, window_start
from hearth.readmodels.rebuild import diff_databases, diff_within_log
from hearth.readmodels.tables import Base, ProjectionPosition
from hearth.protocol.subjects import event_subject
from tests.readmodel_helpers import (LogBuilder, advertised, apply_all, at, constructed, heartbeat, migrated_engine,
                                     stream_of, synthetic_events)
from tests.reputation_events import confirmed
from tests.unit.test_readmodel_retention import forty_days_of_traffic, projection, prune

DAY = seconds_per_day


def live_and_rebuilt(tmp_path, events: list | None = None) -> tuple:
    """A live read model that projected forty days (`events`, or forty_days_of_traffic) as they came, and a rebuild
    from what the streams keep at the end (each drops what is older than its max age); returns both paths and the
    rebuild's window."""
    log = LogBuilder()
    messages = [log.stored(event) for event in events or forty_days_of_traffic()]
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


def forty_days_and_two_late_shards() -> tuple[list, str, str]:
    """forty_days_of_traffic, and two shards that first appear inside the pipelines stream's window: one quarantined
    on day 36, one that served a call on day 20 and was gone a week later (its heartbeats older than the shards
    stream keeps); returns the events and the two shard ids."""
    fresh, quiet = advertised(4, 7, "fresh", t=36 * DAY), advertised(4, 7, "quiet", t=20 * DAY)
    late = [fresh, heartbeat(fresh.shard_id, t=36 * DAY + 1, tokens=40, node="fresh"),
            constructed("f-1", [fresh.shard_id], t=36 * DAY + 5),
            confirmed("f-1", fresh.shard_id, ["w1", "w2"], t=36 * DAY + 6),
            quiet, heartbeat(quiet.shard_id, t=20 * DAY + 1, tokens=500, node="quiet"),
            constructed("q-2", [quiet.shard_id], t=20 * DAY + 5)]
    events = sorted(forty_days_of_traffic() + late, key=lambda event: event.occurred_at)
    return events, fresh.shard_id, quiet.shard_id


def tamper(live, sql: str) -> None:
    engine = migrated_engine(live)
    with engine.begin() as connection:
        assert connection.execute(text(sql)).rowcount == 1
    engine.dispose()


def test_counters_that_began_inside_the_window_are_compared(tmp_path):
    """The pipelines stream dropped its first days, yet a shard whose whole reputation lies inside its window is
    checked: a quarantine the live read model lost, and its calls miscounted, show; the shard quarantined on day 0,
    whose sums began before the window, is still left out whatever live says of it."""
    events, fresh, _ = forty_days_and_two_late_shards()
    rebuilt, live, window = live_and_rebuilt(tmp_path, events)
    assert [str(difference) for difference in diff_within_log(rebuilt, live, window).differences] == []
    tamper(live, f"UPDATE shard_reputation SET status = 'ok' WHERE shard_id = '{fresh}'")
    tamper(live, f"UPDATE shard_stats SET pipelines_joined = 7 WHERE shard_id = '{fresh}'")
    tamper(live, "UPDATE shard_reputation SET status = 'ok', mismatches = 0 WHERE node_id = 'bad'")
    differences = diff_within_log(rebuilt, live, window).differences
    assert [(d.table, d.key, d.kind, d.columns) for d in differences] == [
        ("shard_reputation", {"shard_id": fresh}, "changed", ("status",)),
        ("shard_stats", {"shard_id": fresh}, "changed", ("pipelines_joined",)),
    ]
    assert differences[0].live_row["status"] == "ok" and differences[0].new_row["status"] == "quarantined"


def test_a_heartbeat_total_older_than_the_shards_window_is_left_out(tmp_path):
    """A shard's tokens_served is its latest heartbeat's: once the shards stream dropped that, a rebuild cannot
    give it, even though the calls counted on the shard are all inside the pipelines stream's window."""
    events, _, quiet = forty_days_and_two_late_shards()
    rebuilt, live, window = live_and_rebuilt(tmp_path, events)
    rows = {}
    for name, path in (("live", live), ("rebuilt", rebuilt)):
        engine = migrated_engine(path)
        with engine.connect() as connection:
            rows[name] = connection.execute(text("SELECT tokens_served, pipelines_joined FROM shard_stats "
                                                 f"WHERE shard_id = '{quiet}'")).one()
        engine.dispose()
    assert rows == {"live": (500, 1), "rebuilt": (0, 1)}
    assert [str(difference) for difference in diff_within_log(rebuilt, live, window).differences] == []


def test_counters_held_before_their_start_was_recorded_stay_left_out(tmp_path):
    """A read model migrated from before rows said when their sums began: its counters count as begun before any
    window, while a shard that only heartbeats made has nothing of the pipelines stream to lose."""
    path = tmp_path / "old.db"
    upgrade_database(path, "0013")
    engine = open_engine(path)
    with engine.begin() as connection:
        for shard_id, joined, counted_at in (("called", 3, None), ("counted", 1, 500), ("heartbeats-only", 0, None)):
            connection.execute(text(
                "INSERT INTO shard_stats (shard_id, tokens_served, pipelines_joined, failovers_caused, "
                "corruption_detections, last_counted_at) VALUES (:shard_id, 9, :joined, 0, 0, :counted_at)"),
                dict(shard_id=shard_id, joined=joined, counted_at=counted_at))
        connection.execute(text(
            "INSERT INTO shard_reputation (shard_id, node_id, checks, verified_positions, mismatches, disputes, "
            "status, updated_at) VALUES ('checked', NULL, 2, 8, 0, 0, 'ok', 1000)"))
    engine.dispose()
    upgrade_database(path)
    engine = open_engine(path)
    with engine.connect() as connection:
        window = {PIPELINES_STREAM: 1}  # the earliest a window can start
        assert keys_older_than_log(connection, "shard_stats", ["shard_id"], window) == {("called",), ("counted",)}
        assert keys_older_than_log(connection, "shard_reputation", ["shard_id"], window) == {("checked",)}
    engine.dispose()


def test_a_read_model_migrated_from_before_matches_a_rebuild_of_a_log_that_dropped_nothing(tmp_path):
    """Rows summed before their beginning was recorded hold 0 there, which says nothing: against a rebuild of a whole
    log their counters are still compared, and that 0 is not a difference."""
    log = LogBuilder()
    first, second = advertised(0, 3, "first"), advertised(4, 7, "second")
    messages = [log.stored(event) for event in (
        first, second, heartbeat(first.shard_id, t=1, node="first"),
        constructed("p-1", [first.shard_id, second.shard_id], t=5),
        confirmed("p-1", second.shard_id, ["w1", "w2"], t=6))]
    live, rebuilt = tmp_path / "live.db", tmp_path / "rebuilt.db"
    for path in (live, rebuilt):
        engine = migrated_engine(path)
        apply_all(engine, messages, projection())
        engine.dispose()
    command.downgrade(alembic_config(live), "0013")  # as a projector before that revision left it
    upgrade_database(live)

    assert [str(difference) for difference in diff_databases(rebuilt, live)] == []
    tamper(live, f"UPDATE shard_stats SET pipelines_joined = 7 WHERE shard_id = '{second.shard_id}'")
    assert [(d.table, d.columns) for d in diff_databases(rebuilt, live)] == [("shard_stats", ("pipelines_joined",))]


def test_a_removal_the_shards_stream_dropped_while_the_pipelines_stream_keeps_its_twin_is_left_out(tmp_path):
    """A member's removal is published in both streams and both copies count in one event_counts row
    (minute, member.removed); once the shards stream (7 days) dropped its copy and the pipelines stream (30) has not,
    no rebuild can make that row: it is older than the shards window, not a difference of a healthy read model."""
    seqs = {SHARDS_STREAM: 0, PIPELINES_STREAM: 0}

    def stored(event, stream: str) -> StoredEvent:
        seqs[stream] += 1
        subject = MEMBER_REMOVAL_SUBJECTS[stream] if isinstance(event, MemberRemoved) else event_subject(event)
        return StoredEvent(stream=stream, seq=seqs[stream], subject=subject, time=event.occurred_at, headers={},
                           event=event)

    removals = [stored(MemberRemoved(node_id="system", member="attic", public_key="U" + "A" * 55, stream=stream,
                                     occurred_at=at(60.0)), stream) for stream in (SHARDS_STREAM, PIPELINES_STREAM)]
    later = synthetic_events(seed=1, t0=10 * DAY, shards=2, pipelines=3, heartbeats_per_shard=2)
    messages = removals + [stored(event, stream_of(event)) for event in later]
    live, rebuilt = migrated_engine(tmp_path / "live.db"), migrated_engine(tmp_path / "rebuilt.db")
    apply_all(live, messages, projection())
    apply_all(rebuilt, messages[1:], projection())  # the shards stream kept nothing older than 7 days
    live.dispose()
    rebuilt.dispose()
    first_kept_shard = next(m for m in messages[1:] if m.stream == SHARDS_STREAM)
    window = {SHARDS_STREAM: window_start(first_kept_shard, seqs[SHARDS_STREAM])}

    compared = diff_within_log(tmp_path / "rebuilt.db", tmp_path / "live.db", window)
    assert [str(difference) for difference in compared.differences] == []
    assert compared.left_out_live >= 1
