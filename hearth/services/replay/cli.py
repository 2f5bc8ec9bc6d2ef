"""The `hearth-replay` command: read the event log for audit and debugging, and rebuild read models from it.

Every command reads through ordered, in-memory consumers that are deleted on exit: replaying never
leaves a durable consumer (or any consumer) behind, and never writes to the streams.

`events` without `--stream` reads both streams merged by the time the server stored each message;
with `--follow` the two are interleaved as messages arrive.
"""

from __future__ import annotations

import contextlib
import sys
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from hearth.events.consume import first_stream_seq
from hearth.services.replay.broker import jetstream
from hearth.services.cli_errors import OneLineErrorsGroup
from hearth.services.replay.exits import fail, run_command
from hearth.services.cli_options import (ConfigOption, CredsOption, LogLevelOption, NatsUrlOption,
                                         apply_top_level_options, nats_settings_for, roster_checked,
                                         settings, use_creds)

if TYPE_CHECKING:
    from hearth.services.common.config import NatsSettings

# hearth-replay is a reading tool: quieter than the services (and quick to say when the broker is not there).
replay_log_level = "WARNING"

app = typer.Typer(
    name="hearth-replay",
    cls=OneLineErrorsGroup,
    help="Read hearth's event log (audit, debugging) and rebuild read models from it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name configuration tables as `[shard]`: shown as written, not read as markup.
    rich_markup_mode=None,
)

class OutputFormat(str, Enum):
    table = "table"
    jsonl = "jsonl"


@app.callback()
def main_options(
    ctx: typer.Context,
    config: ConfigOption = None,
    log_level: LogLevelOption = replay_log_level,
    creds: CredsOption = None,
) -> None:
    """Read hearth's event log (audit, debugging) and rebuild read models from it."""
    apply_top_level_options(ctx, config, log_level)
    use_creds(ctx, creds)  # each subcommand takes --creds too, as every other command does


EVENTS_HELP = (
    "Print stored events (with stream, sequence, subject, time); stops at the end of the log unless --follow.\n\n"
    "Without --stream both streams are read, merged by the time the server stored each message; with --follow "
    "they are interleaved as messages arrive, and a stream not created yet is waited for. --from-seq/--to-seq "
    "apply to each stream's own sequence numbers, "
    "so they are most useful with one --stream."
)


@app.command("events", help=EVENTS_HELP)
def events_command(
    ctx: typer.Context,
    stream: Annotated[
        Optional[list[str]],
        typer.Option("--stream", help="HEARTH_SHARDS or HEARTH_PIPELINES (repeatable; default both)."),
    ] = None,
    subject: Annotated[
        Optional[str], typer.Option("--subject", help="NATS subject filter, e.g. 'hearth.events.shard.*.*.withdrawn'.")
    ] = None,
    event_type: Annotated[
        Optional[list[str]],
        typer.Option("--type", help="Event type (pipeline.completed) or family (shard); repeatable."),
    ] = None,
    since: Annotated[
        Optional[str], typer.Option("--since", help="Only messages stored in the last 90s / 15m / 2h / 1d.")
    ] = None,
    from_time: Annotated[
        Optional[str], typer.Option("--from-time", help="Only messages stored at or after this RFC 3339 time.")
    ] = None,
    from_seq: Annotated[
        int, typer.Option("--from-seq", min=1, help="First stream sequence (per stream).")
    ] = first_stream_seq,
    to_seq: Annotated[
        Optional[int], typer.Option("--to-seq", min=1, help="Last stream sequence (per stream).")
    ] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Stop after this many messages.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new messages until Ctrl-C.")] = False,
    output: Annotated[OutputFormat, typer.Option("--output", "-o", help="table or jsonl.")] = OutputFormat.table,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
) -> None:
    """Print stored events (with stream, sequence, subject, time); stops at the end of the log unless --follow."""
    use_creds(ctx, creds)
    from hearth.services.replay.query import LogQuery, QueryError, parse_since, parse_timestamp, select_streams

    if since and from_time:
        raise fail("give --since or --from-time, not both")
    try:
        start_time = None
        if since:
            start_time = parse_since(since, datetime.now(timezone.utc))
        elif from_time:
            start_time = parse_timestamp(from_time)
        types = tuple(event_type or ())
        selections = select_streams(stream, subject, types)
    except QueryError as error:
        raise fail(str(error)) from error
    query = LogQuery(selections=selections, types=types, from_seq=from_seq, to_seq=to_seq, from_time=start_time,
                     follow=follow, limit=limit)
    code = run_command(_print_events(nats_settings_for(ctx, nats_url), query, output))
    raise typer.Exit(code)


async def _print_events(broker: "NatsSettings", query, output: OutputFormat) -> int:
    from dataclasses import replace

    from hearth.events.streams import wait_for_streams
    from hearth.services.replay.query import existing_streams, read_log
    from hearth.services.replay.render import jsonl_line, table_row

    async with jetstream(broker) as js:
        present, missing = await existing_streams(js, [s.stream for s in query.selections])
        if missing and query.follow:  # following is waiting for what comes: the first event creates them
            await wait_for_streams(js, missing, wait_s=None)
            present, missing = present + missing, []
        for name in missing:
            typer.echo(f"hearth-replay: stream {name} does not exist yet (nothing published)", err=True)
        query = replace(query, selections=[s for s in query.selections if s.stream in present])
        if not query.selections:
            return 0
        async with contextlib.aclosing(read_log(js, query)) as items:
            async for item in items:
                typer.echo(jsonl_line(item) if output is OutputFormat.jsonl else table_row(item))
                sys.stdout.flush()
    return 0


@app.command("pipeline")
def pipeline_command(
    ctx: typer.Context,
    pipeline_id: Annotated[str, typer.Argument(help="The pipeline_id (from a `pipeline` frame or the events).")],
    output: Annotated[OutputFormat, typer.Option("--output", "-o", help="table or jsonl.")] = OutputFormat.table,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
) -> None:
    """One pipeline's timeline: constructed, first token, shard status, failovers, fallback, end, integrity; then its
    outcome (completed, aborted, fallback_local, running; a completed call's verification met or unmet when it says),
    which -o jsonl puts on its last line as `outcome` and `verification`."""
    use_creds(ctx, creds)
    import re

    from hearth.protocol.bounds import SUBJECT_TOKEN_PATTERN

    if not re.match(SUBJECT_TOKEN_PATTERN, pipeline_id):
        raise fail(f"pipeline_id {pipeline_id!r} must match {SUBJECT_TOKEN_PATTERN}")
    raise typer.Exit(run_command(_print_pipeline(nats_settings_for(ctx, nats_url), pipeline_id, output)))


async def _print_pipeline(broker: "NatsSettings", pipeline_id: str, output: OutputFormat) -> int:
    from hearth.events.consume import StoredEvent, read_stream
    from hearth.events.streams import PIPELINES_STREAM
    from hearth.protocol.subjects import EVENTS_PREFIX
    from hearth.services.replay.query import existing_streams
    from hearth.services.replay.render import jsonl_line
    from hearth.services.replay.reports import pipeline_end, pipeline_timeline

    filters = [f"{EVENTS_PREFIX}.pipeline.{pipeline_id}.>", f"{EVENTS_PREFIX}.integrity.{pipeline_id}.>"]
    async with jetstream(broker) as js:
        present, _ = await existing_streams(js, [PIPELINES_STREAM])
        events: list[StoredEvent] = []
        if present:
            async with contextlib.aclosing(read_stream(js, PIPELINES_STREAM, subject_filter=filters)) as items:
                events = [item async for item in items if isinstance(item, StoredEvent)]
    if not events:
        typer.echo(f"hearth-replay: no events for pipeline {pipeline_id}", err=True)
        return 1
    end = pipeline_end(events)
    if output is OutputFormat.jsonl:
        start = events[0].event.occurred_at
        # The last line carries the outcome the table's last line states.
        ending = {"outcome": end.outcome, **({"verification": end.verification} if end.verification else {})}
        for index, item in enumerate(events, 1):
            typer.echo(jsonl_line(item, offset_s=round((item.event.occurred_at - start).total_seconds(), 6),
                                  **(ending if index == len(events) else {})))
        return 0
    for line in pipeline_timeline(pipeline_id, events):
        typer.echo(line)
    typer.echo(f"outcome: {end}")
    return 0


@app.command("shard")
def shard_command(
    ctx: typer.Context,
    shard: Annotated[str, typer.Argument(help="A shard_id ('<model>:<lo>-<hi>[+<scheme>]@<node>') or its shard_key.")],
    health_timeout_s: Annotated[
        Optional[float],
        typer.Option(
            "--health-timeout-s",
            min=0.001,
            help="Report heartbeat gaps longer than this (default: shard_health_timeout_s, 30).",
            show_default=False,
        ),
    ] = None,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
) -> None:
    """One shard's life (advertisements, heartbeat gaps longer than the health timeout, withdrawal) and the
    verification evidence about it (checks, mismatches with witnesses, error against tolerance, digest, clearings)."""
    use_creds(ctx, creds)
    import re

    from hearth.protocol.subjects import shard_key

    key = shard if re.fullmatch(r"[0-9a-f]{4,64}", shard) else shard_key(shard)
    timeout_s = health_timeout_s
    if timeout_s is None:
        timeout_s = settings(ctx).research.distributed_inference.shard_health_timeout_s
    from hearth.services.common.event_trust import event_verifier

    # The live projectors' check, so the evidence shown is what the read model applied.
    verifier = roster_checked("hearth-replay", lambda: event_verifier(settings(ctx)))
    raise typer.Exit(run_command(_print_shard(nats_settings_for(ctx, nats_url), shard, key, float(timeout_s),
                                       verifier)))


async def _print_shard(broker: "NatsSettings", shard: str, key: str, health_timeout_s: float, verifier) -> int:
    from hearth.services.replay.shard_view import read_shard_log, shard_view_lines

    async with jetstream(broker) as js:
        own, outcomes = await read_shard_log(js, shard, key)
    lines = shard_view_lines(shard, key, own, outcomes, health_timeout_s, now=datetime.now(timezone.utc),
                             verifier=verifier)
    if not lines:
        typer.echo(f"hearth-replay: no events for shard {shard} (key {key})", err=True)
        return 1
    for line in lines:
        typer.echo(line)
    return 0


@app.command("rebuild")
def rebuild_command(
    ctx: typer.Context,
    db: Annotated[Path, typer.Option("--db", help="Where to write the fresh read model (must not exist).")],
    diff: Annotated[Optional[Path], typer.Option(
        "--diff", help="A live read model to compare with; exit 1 when a row the log holds differs.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --db file.")] = False,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
) -> None:
    """Build a fresh read model from the whole event log; with --diff, print every row that differs."""
    use_creds(ctx, creds)
    if diff is not None and not diff.is_file():
        raise fail(f"no read-model database at {diff}")
    if diff is not None and db.exists() and db.samefile(diff):  # --force would delete the rows it is to compare
        raise fail(f"--db and --diff name one file ({diff}); rebuild into another file to compare with it")
    if db.is_dir():
        raise fail(f"{db} is a folder; --db names the file to write (e.g. {db / 'readmodel.sqlite'})")
    if db.exists() and not force:
        raise fail(f"{db} exists; a rebuild writes a fresh database (use --force to replace it)")
    from hearth.services.common.event_trust import event_verifier

    # The live projectors' check (when the community's roster is at hand), so the rebuilt rows match theirs.
    verifier = roster_checked("hearth-replay", lambda: event_verifier(settings(ctx)))
    readmodels = settings(ctx).readmodels  # and the live projectors' retention
    raise typer.Exit(run_command(_rebuild(nats_settings_for(ctx, nats_url), db, diff, force, verifier, readmodels)))


async def _rebuild(broker: "NatsSettings", db: Path, diff: Path | None, force: bool, verifier=None,
                   readmodels=None) -> int:
    import asyncio

    from hearth.events.streams import ALL_STREAMS
    from hearth.readmodels.rebuild import ReadModelUnusable, diff_within_log, rebuild_database
    from hearth.readmodels.retention import retention_policy
    from hearth.services.replay.query import existing_streams

    async with jetstream(broker) as js:
        present, missing = await existing_streams(js, ALL_STREAMS)
        for name in missing:
            typer.echo(f"hearth-replay: stream {name} does not exist yet; nothing to read from it", err=True)
        retention = None if readmodels is None else retention_policy(readmodels)
        window: dict[str, int] = {}
        try:
            applied = await rebuild_database(js, db, overwrite=force, streams=present, verifier=verifier,
                                             retention=retention, window=window)
        except ReadModelUnusable as error:  # no room for it, say
            raise fail(str(error), 1) from None
    typer.echo(f"rebuilt {db} from {applied} messages")
    if diff is None:
        return 0
    try:
        compared = await asyncio.to_thread(diff_within_log, db, diff, window)
    except ReadModelUnusable as error:  # a damaged --diff file, or one of another schema revision
        raise fail(f"cannot compare with {diff}: {error}") from None
    for line in [*compared.window_lines(db, diff), *map(str, compared.differences)]:
        typer.echo(line)
    if compared.differences:
        typer.echo(f"{len(compared.differences)} rows differ between {db} (from the log) and {diff}", err=True)
        return 1
    typer.echo(f"no differences between {db} and {diff}")
    return 0


@app.command("verify")
def verify_command(
    ctx: typer.Context,
    roster: Annotated[Optional[Path], typer.Option(
        "--roster", help="The community roster (default: nats.roster_file, or the one beside the key).",
        show_default=False)] = None,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
) -> None:
    """Check every stored event: signed by a roster member whose role may emit it, for its own node, not dated
    more than events.max_clock_skew_s after it was stored, not a copy of one before it (duplicate) nor older than
    the [readmodels] retention of its stream (too_old). Prints each bad one; exit 1 if there is any."""
    use_creds(ctx, creds)
    from hearth.events.signing import EventVerifier
    from hearth.services.common.event_trust import community_roster_file
    from hearth.trust.roster import Roster, RosterError

    current = settings(ctx)
    roster_file = roster or roster_checked("hearth-replay", lambda: community_roster_file(current.nats))
    if roster_file is None:
        raise fail("verify needs the community roster: give --roster FILE (or [nats] roster_file)")
    try:
        verifier = EventVerifier(Roster.load(roster_file), max_clock_skew_s=current.events.max_clock_skew_s)
    except RosterError as error:
        raise fail(str(error)) from error
    raise typer.Exit(run_command(_verify(nats_settings_for(ctx, nats_url), verifier, current.readmodels)))


async def _verify(broker: "NatsSettings", verifier, readmodels) -> int:
    from hearth.events.streams import ALL_STREAMS
    from hearth.readmodels.retention import retention_policy
    from hearth.services.replay.query import existing_streams
    from hearth.services.replay.verify import verify_streams

    async with jetstream(broker) as js:
        present, missing = await existing_streams(js, ALL_STREAMS)
        for name in missing:  # deleted, or never created: an audit says what it could not read
            typer.echo(f"hearth-replay: stream {name} does not exist; nothing verified there", err=True)
        report = await verify_streams(js, verifier, present, on_bad=lambda bad: typer.echo(bad.line()),
                                      retention=retention_policy(readmodels))
    typer.echo(report.summary())
    return 0 if report.ok else 1


def main() -> None:
    app()


if __name__ == "__main__":
    main()
