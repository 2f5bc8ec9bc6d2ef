"""`hearth community publish-pending`: the one way a steward puts on the event log the member changes the roster holds
and some stream's log lacks (hearth/services/community_pending.py), what it says per stream, and the note
`add`, `remove` and `rotate-key` keep of such changes for `list` (hearth/trust/unpublished_changes.py), which `remove`
and `rotate-key` settle too for the earlier changes of their member they publish first;
hearth/services/community_cli.py registers it."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from hearth.services.cli_options import CommunityNatsOption, settings
from hearth.services.community_cli_messages import PUBLISH_PENDING
from hearth.services.community_cli_options import DEFAULT_COMMUNITY_DIR, DirOption, fail

if TYPE_CHECKING:
    from hearth.services.community_removal import PublishedRemoval, StreamCatchUp
    from hearth.trust.unpublished_changes import MemberChangeKind

COMMAND = PUBLISH_PENDING


def publish_pending_command(
    ctx: typer.Context,
    name: Annotated[Optional[str], typer.Option(
        "--name", help="Only this member's changes (current or removed); default: every member's.",
        show_default=False)] = None,
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: CommunityNatsOption = None,
) -> None:
    """Publish on each event stream the member changes the roster holds and that stream's log lacks: after an `add`,
    `remove` or `rotate-key` run with --offline, with the broker out of reach, or that a stream did not take. Each
    stream's members subject is read first, and only what it lacks goes there, in the order a reader meets it: a
    member's addition (a member added before the community had a broker too), each rotation of its key, a removed
    member's removal. Run again, it publishes nothing twice. It says per stream what it published and whose changes
    it held already. The roster does not change; exit 1 when a stream did not take a change (run it again)."""
    from hearth.events.streams import StreamsMissing
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.services.community_pending import publish_community_pending
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import RosterError

    community = Community(directory)
    try:
        caught_up = publish_community_pending(community, name, nats_url, settings(ctx))
    except (RosterError, KeyFileError, BrokerUnreachable, StreamsMissing) as error:
        fail(f"{error}; nothing was published", COMMAND)
    for stream, done in caught_up.items():
        for line in catch_up_lines(stream, done):
            typer.echo(line, err=line.startswith(COMMAND))
    members = {name} if name is not None else {member.name for member in community.roster().members} | {
        gone.member.name for gone in community.roster().removed}
    lacking: dict[str, set[str]] = {}
    for stream, done in caught_up.items():
        for member in members if done.unread is not None else done.lacking():
            lacking.setdefault(member, set()).add(stream)
    settle_the_note(COMMAND, directory, members, lacking)
    if any(done.unread is not None or done.refused is not None for done in caught_up.values()):
        raise typer.Exit(1)


def catch_up_lines(stream: str, done: StreamCatchUp) -> list[str]:
    """What `publish-pending` says of one stream: each change published and where, whose changes it held, and (as
    warnings, naming the command) what it did not take or could not read, and what cannot be published."""
    if done.unread is not None:
        return [f"{COMMAND}: warning: {stream}'s member changes could not be read ({done.unread}): nothing was "
                "published there; run it again"]
    lines = [f"{stream}: published {change.what} at #{seq}" for change, seq in done.published]
    if done.held:
        lines.append(f"{stream}: holds every change of {', '.join(done.held)}")
    if done.refused is not None:
        change, why = done.refused
        waiting = f"; {len(done.waiting)} more wait for it" if done.waiting else ""
        lines.append(f"{COMMAND}: warning: {stream} did not take {change.what} ({why}){waiting}: run it again")
    lines += [f"{COMMAND}: warning: {stream} lacks {what}, which only that retired key signs, so it cannot be "
              "published now: there, readers go by their roster copy (hand it out)" for what in done.unpublishable]
    return lines


def note_what_the_log_lacks(command: str, directory: Path, member: str, change: MemberChangeKind,
                            streams: Iterable[str] | None) -> None:
    """Note, for `list` and `publish-pending` (which settles it), that `streams`' logs (None: every stream's) lack
    `member`'s `change`; a note that cannot be written is said, never fatal (publish-pending reads the log itself)."""
    from hearth.events.streams import ALL_STREAMS
    from hearth.trust.unpublished_changes import note_unpublished

    streams = list(ALL_STREAMS if streams is None else streams)
    if not streams:
        return
    try:
        note_unpublished(directory, member, change, streams)
    except OSError as error:
        typer.echo(f"{command}: warning: could not note the unpublished {change} ({error.strerror}); "
                   f"`{PUBLISH_PENDING}` still finds it", err=True)


def publish_earlier_first(command: str, directory: Path, member: str, published: PublishedRemoval) -> None:
    """What `remove` and `rotate-key` say of the earlier changes of `member` they published first on a stream whose
    log lacked them, and the note of unpublished changes settled for `member` on each stream that now holds them all
    (the note of this run's change comes after, note_what_the_log_lacks)."""
    from hearth.events.streams import ALL_STREAMS

    for stream, done in published.earlier.items():
        for change, seq in done.published:
            typer.echo(f"{stream}: published {change.what} at #{seq} first (its log lacked it)")
    settled = set(published.earlier) - set(published.failures)
    if settled:
        settle_the_note(command, directory, {member}, {member: set(ALL_STREAMS) - settled})


def settle_the_note(command: str, directory: Path, members: Collection[str],
                    lacking: Mapping[str, Collection[str]]) -> None:
    """settle_unpublished, a note that cannot be written said, never fatal (publish-pending reads the log itself)."""
    from hearth.trust.unpublished_changes import settle_unpublished

    try:
        settle_unpublished(directory, members, lacking)
    except OSError as error:
        typer.echo(f"{command}: warning: the note of unpublished changes could not be updated ({error.strerror}): "
                   "`hearth community list` may still show them", err=True)


def unpublished_lines(directory: Path) -> list[str]:
    """`list`'s lines for the changes noted as missing from the log."""
    from hearth.trust.unpublished_changes import read_unpublished

    try:
        changes = read_unpublished(directory)
    except (ValueError, OSError) as error:
        return [f"unpublished changes: the note does not read ({error}); `{PUBLISH_PENDING}` reads the log itself"]
    return [f"{noted.member}: its {noted.change} is not in the log of {', '.join(noted.streams)}: "
            f"`{PUBLISH_PENDING}` puts it there" for noted in changes]
