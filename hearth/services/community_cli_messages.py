"""What `hearth community` says after changing the roster: where the change is in the event log, what the steward
does next (hand out the roster, give a member its seed), and the warnings and refusals when the log lacks it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, NoReturn

import typer

from hearth.services.community_cli_options import fail

if TYPE_CHECKING:
    from pathlib import Path

    from hearth.services.community_removal import PublishedRemoval
    from hearth.trust.roster import Member, RemovalCut

# The one way to put on the log what a change's command could not (hearth/services/community_pending_cli.py).
PUBLISH_PENDING = "hearth community publish-pending"


def addition_reaches_the_members(directory: Path, name: str, where: str) -> str:
    """What the steward does next after adding a member: the member's own machine needs the roster (and its seed);
    every other machine's processes take the member from the addition in the log (`where` it went: none, then the
    roster must be handed out)."""
    roster = directory / "roster.json"
    if not where:
        return (f"No stream took its addition: hand the new roster.json ({roster}) to every member's machine; until "
                f"its copy names {name}, processes there reject {name}'s events, calls and opens (unknown_signer), "
                f"or until `{PUBLISH_PENDING}` puts the addition on the log.")
    return (f"Its addition is at {where}: other members' projectors, orchestrators and shard hosts accept {name} from "
            f"the event log before their roster copy names it. Give {name}'s machine the new roster.json ({roster}) "
            "with its seed; handing the roster to every member is still recommended (a stream that did not take the "
            "addition, and a process started after it aged out of the log, go by the roster).")


def warn_where_the_log_lacks_the_addition(command: str, published: PublishedRemoval, why_not: str | None) -> None:
    """One warning for each stream that did not take the addition (or, `why_not`, none was published): there, other
    households take the member only once their roster copy names it."""
    later = f"or once `{PUBLISH_PENDING}` puts the addition there"
    if why_not is not None:
        typer.echo(f"{command}: warning: the addition was not published ({why_not}): other households take the "
                   f"member only once their roster copy names it, {later}", err=True)
    for stream, why in published.failures.items():
        typer.echo(f"{command}: warning: {stream} did not take the addition event ({why}): there, other households "
                   f"take the member only once their roster copy names it, {later}", err=True)


def rotation_reaches_the_members(directory: Path, name: str, logged: bool) -> str:
    """What the steward does next after a member's key changed: the member's own machine needs its new seed with the
    roster naming it; every other machine's processes learn the new key from the rotation in the log (where a stream
    took it), so handing the roster out is recommended, not needed for the mesh to keep working."""
    roster = directory / "roster.json"
    if not logged:
        return (f"No stream took the rotation: hand the new roster.json ({roster}) to every member's "
                f"machine; until its copy names {name}'s new key, processes there reject that key's events, calls and "
                f"opens (unknown_signer), or until `{PUBLISH_PENDING}` puts the rotation on the log.")
    return (f"Give {name}'s machine its new seed with the new roster.json ({roster}). Other members' projectors, "
            f"orchestrators and shard hosts accept {name}'s new key from the rotation in the event log, before their "
            "roster copy names it; handing the roster to every member is still recommended (a stream that did not "
            "take the rotation, and a process started after the rotation aged out of the log, go by the roster).")


# What the roster's change needs on the broker, said after a removal or a key's rotation.
BROKER_APPLIES_IT = ("A broker run by `hearth nats --community` applies it at once; any other: render "
                     "`hearth community nats-config` and reload it.")


def not_published(error: Exception, command: str, *, cut_off: str) -> NoReturn:
    """The refusal of a removal or rotation whose event no stream took: nothing changed, and the two ways out."""
    fail(f"{error}; nothing was changed. Give the broker with --nats, or --offline to change the roster alone "
         f"(projections then cut {cut_off} off by this machine's clock)", command)


def log_positions(cuts: Sequence[RemovalCut], published: PublishedRemoval) -> str:
    """Where the removal or rotation event is in each stream, naming those an earlier run published."""
    earlier = {stream: " (published by an earlier run)" for stream in published.found}
    return ", ".join(f"{cut.stream} #{cut.seq}{earlier.get(cut.stream, '')}" for cut in cuts)


def former_key_row(member: Member, status: str, public_key: str, since: datetime,
                    cuts: Sequence[RemovalCut]) -> str:
    """`list`'s row of a key that no longer counts: its member, why (removed, retired), since when and where."""
    where = "".join(f", {cut.stream} #{cut.seq}" for cut in cuts)
    return f"{member.name:24} {member.role:13} {status:8} {public_key}  at {since:%Y-%m-%d %H:%M:%S} UTC{where}"


def warn_where_the_log_lacks_it(command: str, published: PublishedRemoval, offline: bool, *, event: str,
                                 cut_off: str, publishable: bool = True) -> None:
    """One warning for each stream that did not take the `event` event (or for --offline, none did): there the key
    is cut off by the steward's clock, not by a position in the log; `publishable`: PUBLISH_PENDING can put it
    there later (not the steward's rotation of its own key, which only the retired key signs)."""
    later = (f"`{PUBLISH_PENDING}` puts the event there for readers whose roster copy is older" if publishable else
             "hand the roster out")
    for stream, why in published.failures.items():
        typer.echo(f"{command}: warning: {stream} did not take the {event} event ({why}): there, {cut_off} cut off "
                   f"by this machine's clock; {later}", err=True)
    if offline:
        typer.echo(f"{command}: warning: no {event} event published (--offline): {cut_off} cut off by this "
                   f"machine's clock; {later}", err=True)
