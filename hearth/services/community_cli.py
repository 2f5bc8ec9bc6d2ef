"""`hearth community`: create a community, add and remove members (a member may make its key itself: `keygen`)
and replace their keys, the steward's own too
(each an nkey; a removal or a key's retirement is also published in the event log,
hearth/services/community_removal.py; what the log lacks of them is published later by `publish-pending`,
hearth/services/community_pending_cli.py), list them with the keys removed or retired, show
shard hosts' reputation from a read model and let a steward clear a quarantine
(hearth/services/community_reputation.py); the commands that set up the broker's and the gateway's files (API keys,
TLS, the authorization block, the streams) are hearth/services/community_broker_cli.py's."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hearth.services.cli_options import CommunityNatsOption, settings
from hearth.services.community_broker_cli import api_key_command, nats_config_command, streams_command, tls_command
from hearth.services.community_pending_cli import (
    note_what_the_log_lacks, publish_earlier_first, publish_pending_command, unpublished_lines,
)
from hearth.services.community_cli_messages import (
    BROKER_APPLIES_IT,
    former_key_row,
    addition_reaches_the_members,
    warn_where_the_log_lacks_the_addition,
    log_positions,
    not_published,
    rotation_reaches_the_members,
    warn_where_the_log_lacks_it,
)
from hearth.services.community_cli_options import (
    DEFAULT_COMMUNITY_DIR,
    DEFAULT_READ_MODEL,
    DirOption,
    ReadModelOption,
    fail,
)

community_app = typer.Typer(help="Manage a community: its roster, member keys and the broker's permissions.",
                            rich_markup_mode=None,
                            no_args_is_help=True)


@community_app.command("init")
def init_command(
    name: Annotated[str, typer.Option("--name", help="The community's name, e.g. 'elm-street'.")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
) -> None:
    """Create a community folder (mode 0700): a roster whose one member is `system`, the steward's own key
    (keys/system.nk, mode 0600), which the broker lets do anything."""
    from hearth.trust.community import Community
    from hearth.trust.roster import RosterError

    try:
        community = Community.init(directory, name)
    except (RosterError, ValueError) as error:
        fail(str(error))
    except OSError as error:  # a file where the folder goes, no permission
        fail(f"cannot create the community in {directory}: {error.strerror or error}")
    typer.echo(f"created community {name!r} in {directory}: roster {community.roster_path}, "
               f"system key {community.system_key_path} (keep it with the broker; never share it)")


@community_app.command("add")
def add_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="Member name: its node id and inbox token ([A-Za-z0-9_-]).")],
    role: Annotated[str, typer.Option("--role", help="shard | orchestrator | projector | client | auditor")],
    trust: Annotated[Optional[str], typer.Option(
        "--trust", help="member | trusted | steward (default: trusted for shard, orchestrator and projector; "
                        "member otherwise). Only trusted or higher may serve shards or orchestrate.",
        show_default=False)] = None,
    public_key: Annotated[Optional[str], typer.Option(
        "--public-key", help="The member's own nkey public key (U...), when it made its key itself; else a key "
                             "pair is generated and its seed written to keys/NAME.nk (mode 0600).")] = None,
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: CommunityNatsOption = None,
    offline: Annotated[bool, typer.Option(
        "--offline", help="Change the roster only, publishing no addition event (no broker to reach): other "
                          "households then take the member only once their roster copy names it.")] = False,
) -> None:
    """Add a member to the roster, then publish a signed member.added (the steward's system key) on each event
    stream: other households' projectors, orchestrators and shard hosts take the member from the log before their
    roster copy names it (with no --nats, the configured broker is tried for 2 s: none running yet, as while a
    community is set up, leaves the addition to the roster alone). A broker run by `hearth nats --community DIR` lets
    it in within seconds; for any other, render `hearth community nats-config` and reload the broker."""
    from hearth.services.community_addition import publish_community_addition
    from hearth.services.community_removal import PublishedRemoval
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import ROLES, TRUST_ORDER, RosterError

    if role not in ROLES:
        fail(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if trust is not None and trust not in TRUST_ORDER:
        fail(f"--trust must be one of {', '.join(TRUST_ORDER)}, not {trust!r}")
    try:
        added = Community(directory).add(name, role, trust=trust, public_key=public_key)  # type: ignore[arg-type]
    except RosterError as error:
        held = already_added(directory, name)
        fail(f"{error}{held}")
    except (KeyFileError, ValueError) as error:
        fail(str(error))
    except OSError as error:
        fail(f"cannot write the roster or the key in {directory}: {error.strerror}; nothing was added")
    member = added.member
    published, why_not = PublishedRemoval(), None
    if not offline:
        try:  # the roster holds the member: a log that lacks it only means handing the roster out, as before
            published = publish_community_addition(Community(directory), member, nats_url, settings(ctx))
        except Exception as error:  # no system key, no broker, no streams: said in one line
            why_not = str(error) or type(error).__name__
    where = f"; its key: {added.seed_file} (give it to {name}, then delete it here)" if added.seed_file else ""
    typer.echo(f"added {member.name} as {member.role} ({member.trust}), public key {member.public_key}{where}. "
               f"{addition_reaches_the_members(directory, member.name, log_positions(published.cuts, published))}")
    warn_where_the_log_lacks_the_addition("hearth community add", published, why_not)
    lacking = None if offline or why_not is not None else published.failures
    note_what_the_log_lacks("hearth community add", directory, member.name, "addition", lacking)


def already_added(directory, name: str) -> str:
    """What `add` says when the roster already names `name`: how to publish its addition, if the log lacks it."""
    from hearth.trust.community import Community
    from hearth.trust.roster import RosterError

    try:
        held = Community(directory).roster().by_name(name) is not None
    except RosterError:
        held = False
    return (f"; if its addition is not in the event log yet, `hearth community publish-pending --name {name}` "
            "publishes it") if held else ""


@community_app.command("keygen")
def keygen_command(
    name: Annotated[str, typer.Option("--name", help="This member's name, as the steward will add it.")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
) -> None:
    """Make this machine's member key, for a steward to add with `hearth community add --public-key`: the seed goes
    to DIR/keys/NAME.nk (mode 0600; never replaced) and stays here; the public key, all the steward needs, is
    printed on stdout. Put the roster the steward sends back beside it, as DIR/roster.json."""
    import re

    from hearth.trust.keys import KeyFileError, MemberKey, make_private_folder
    from hearth.trust.roster import MEMBER_NAME_PATTERN, seed_path

    if not re.match(MEMBER_NAME_PATTERN, name):
        fail(f"--name {name!r} is no member name (letters, digits, '_' and '-', at most 63)")
    key, seed_file = MemberKey.generate(), seed_path(directory, name)
    try:
        make_private_folder(directory)  # the roster will join the seed here: the folder as `community init` makes it
        key.save(seed_file)
    except KeyFileError as error:
        fail(str(error))
    except OSError as error:
        fail(f"cannot write the key in {directory}: {error.strerror or error}")
    typer.echo(f"wrote this member's key to {seed_file} (keep it here); give the steward its public key for "
               f"`hearth community add --name {name} --role ROLE --public-key ...`:", err=True)
    typer.echo(key.public_key)


@community_app.command("remove")
def remove_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="The member to remove (not `system`, the steward's key).")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: CommunityNatsOption = None,
    offline: Annotated[bool, typer.Option(
        "--offline", help="Change the roster only, publishing no removal event (no broker to reach): projections "
                          "then cut the member's events off by this machine's clock, not by a position in the log."
    )] = False,
) -> None:
    """Remove a member: first a signed member.removed (the steward's system key, DIR/keys/system.nk) goes on each
    event stream, then the roster records where. The broker refuses its key from then on (a broker run by `hearth
    nats --community DIR` applies the roster within seconds and closes its connections), its gateway API keys are
    revoked, calls it signs are refused, and events each stream stores from it after its removal event are rejected
    (`removed_signer`), while what it signed before still verifies. Its name and key can never join again (its
    history stays theirs); a member coming back is added with new ones. Run again after a failure, it keeps the
    removal events an earlier run published and publishes only where none is. A stream whose log lacks the member's
    earlier changes (its addition, a rotation) gets them first, in order, as `publish-pending` would."""
    from hearth.events.streams import StreamsMissing
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.services.community_pending import earlier_changes
    from hearth.services.community_removal import PublishedRemoval, RemovalNotPublished, publish_community_removal
    from hearth.services.gateway.keys import API_KEYS_FILE, ApiKeyError, revoke_api_keys
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import RosterError

    command = "hearth community remove"
    community = Community(directory)
    published = PublishedRemoval()
    try:
        community.check_removable(name)  # before anything changes, so a refusal leaves everything as it was
        if not offline:
            published = publish_community_removal(community, name, nats_url, settings(ctx), earlier=earlier_changes)
        # Its API keys go next: a removal that fails there can simply be run again (which finds its events).
        api_keys = revoke_api_keys(directory, name) if (directory / API_KEYS_FILE).is_file() else 0
        # The removal dates from the first run that published it only where each stream holds it (a cut): a stream
        # without one cuts by the roster's time, and projections applied what the member stored there until now.
        began = published.found_since if not published.failures else None
        removed, seed_file = community.remove(name, cuts=published.cuts, removed_at=began)
    except (RosterError, ApiKeyError, KeyFileError) as error:
        fail(str(error), command)
    except (BrokerUnreachable, StreamsMissing, RemovalNotPublished) as error:
        not_published(error, command, cut_off="its events")
    except OSError as error:  # the roster (or the API keys file) could not be written
        fail(f"{error.strerror}: {name} is still in the roster; run it again (it keeps the removal events "
              "already published)", command)
    member = removed.member
    deleted = f"; deleted {seed_file}" if seed_file else ""
    where = log_positions(removed.cuts, published)
    logged = f"; its removal is at {where}" if where else ""
    typer.echo(f"removed {member.name} ({member.role}, {member.trust}), public key {member.public_key}{deleted}; "
               f"revoked its {api_keys} API keys{logged}. {BROKER_APPLIES_IT}")
    warn_where_the_log_lacks_it(command, published, offline, event="removal", cut_off="its events are")
    publish_earlier_first(command, directory, name, published)
    note_what_the_log_lacks(command, directory, name, "removal", None if offline else published.failures)


@community_app.command("rotate-key")
def rotate_key_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The member whose key is replaced (`system`: the steward's own).")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: CommunityNatsOption = None,
    public_key: Annotated[Optional[str], typer.Option(
        "--public-key", help="The member's own new nkey public key (U...), when it made its key itself; else a key "
                             "pair is generated and its seed written to keys/NAME.nk (mode 0600).")] = None,
    offline: Annotated[bool, typer.Option(
        "--offline", help="Change the roster only, publishing no rotation event: projections then cut the old key "
                          "off by this machine's clock, not by a position in the log.")] = False,
) -> None:
    """Replace a member's key (leaked, or its machine replaced), keeping its name, node, shards' reputation and
    record: a signed member.key_rotated (the steward's system key) goes on each event stream, then the roster holds
    the new key and keeps the old one among its retired keys. What the old key signed before still verifies; from
    then on the broker, signed calls, events, sealed hop keys and the gateway refuse it. The old key's seed here, if
    any, is deleted (a retired seed still opens hop keys sealed to it before). The steward's own key (`system`) is
    rotated the same way: its old key signs the rotation naming the new one, whose seed is made here in
    keys/system.nk; then every machine with the steward's tooling needs the new folder and every node of a cluster a
    restart (its route password derives from the key); members' projectors, orchestrators (calls) and shard hosts
    (opens) learn the new key from the rotation in the log, and the new roster is still best handed to every member.
    A stream whose log lacks the member's earlier changes (its addition, an earlier rotation) gets them first, in
    order, as `publish-pending` would."""
    from hearth.events.streams import StreamsMissing
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.services.community_removal import EarlierRemovalDiffers, RemovalNotPublished
    from hearth.services.community_rotation import rotate_member_key
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import RosterError

    command = "hearth community rotate-key"
    try:
        rotated, published = rotate_member_key(Community(directory), name, public_key=public_key, nats_url=nats_url,
                                               settings=settings(ctx), offline=offline)
    except (RosterError, KeyFileError, ValueError, EarlierRemovalDiffers) as error:
        fail(str(error), command)
    except (BrokerUnreachable, StreamsMissing, RemovalNotPublished) as error:
        not_published(error, command, cut_off="the old key")
    except OSError as error:  # a seed or the roster could not be written: both are as they were
        fail(f"{error.strerror}: {name} keeps its old key; run it again", command)
    where = log_positions(rotated.retired.cuts, published) or "no stream (--offline)"
    steward = rotated.member.role == "system"
    handed = "keep it with the broker; never share it" if steward else f"give it to {name}, then delete it here"
    seed = f"; its new seed: {rotated.seed_file} ({handed})" if rotated.seed_file else ""
    if rotated.old_seed_deleted is None:
        deleted = ""
    elif rotated.old_seed_deleted == rotated.seed_file:  # one path: "the old seed at <it> is deleted" read as the new
        deleted = "; it replaced the old key's seed there"
    else:
        deleted = f"; the old key's seed at {rotated.old_seed_deleted} is deleted"
    handed_out = "" if steward else f" {rotation_reaches_the_members(directory, name, bool(rotated.retired.cuts))}"
    typer.echo(f"rotated the key of {name}: retired {rotated.retired.public_key} (at {where}), now "
               f"{rotated.member.public_key}{seed}{deleted}. {BROKER_APPLIES_IT}{handed_out}")
    warn_where_the_log_lacks_it(command, published, offline, event="rotation", cut_off="the old key is",
                                publishable=not steward)
    publish_earlier_first(command, directory, name, published)
    if not steward:  # only the retired key signs the steward's own rotation: it cannot be published later
        note_what_the_log_lacks(command, directory, name, "key rotation",
                                None if offline else published.failures)
    if steward:
        typer.echo(f"The steward's key changed: copy {rotated.seed_file} and {directory / 'roster.json'} to every "
                   "machine that runs the broker or the steward's tooling, and restart every node of a cluster "
                   "with the new folder (their route password derives from this key: nodes on the old and the new "
                   "one do not route to each other). Members' projectors learn the new key from the rotation on "
                   "each stream that took it, and their orchestrators and shard hosts for signed calls and opens; "
                   "hand the roster to every member too, as a stream that did not take it goes by the roster alone.")


@community_app.command("list")
def list_command(directory: DirOption = DEFAULT_COMMUNITY_DIR, db: ReadModelOption = DEFAULT_READ_MODEL) -> None:
    """Print the roster: name, role, trust, public key, and (from the read model, when there is one) the shards of
    each member that are quarantined, which hold the member's node (none of its shards is routed); then the members
    removed and the keys retired by a rotation (whose, when, and where in each stream)."""
    from hearth.services.community_reputation import quarantined_shards_by_node
    from hearth.trust.community import Community
    from hearth.trust.roster import RosterError

    try:
        roster = Community(directory).roster()
    except RosterError as error:
        fail(str(error))
    quarantined = quarantined_shards_by_node(db)
    typer.echo(f"community {roster.community!r}: {len(roster.members)} members")
    for member in roster.members:
        shards = quarantined.get(member.name)
        note = f"  node held, none of its shards routed; QUARANTINED: {', '.join(shards)}" if shards else ""
        typer.echo(f"{member.name:24} {member.role:13} {member.trust:8} {member.public_key}{note}")
    for gone in roster.removed:
        typer.echo(former_key_row(gone.member, "removed", gone.member.public_key, gone.removed_at, gone.cuts))
    for holder, retired in roster.retirements():
        typer.echo(former_key_row(holder, "retired", retired.public_key, retired.retired_at, retired.cuts))
    for line in unpublished_lines(directory):
        typer.echo(line)


@community_app.command("reputation")
def reputation_command(db: ReadModelOption = DEFAULT_READ_MODEL) -> None:
    """Each shard's reputation from the read model: checks that found nothing wrong, the positions they verified,
    mismatches confirmed against it, disputes, and whether it is quarantined (since when, on what evidence)."""
    from hearth.services.community_reputation import ReadModelMissing, read_reputation, reputation_lines

    try:
        rows = read_reputation(db)
    except ReadModelMissing as error:
        fail(str(error), "hearth community reputation")
    for line in reputation_lines(rows):
        typer.echo(line)


@community_app.command("clear-quarantine")
def clear_quarantine_command(
    ctx: typer.Context,
    shard_id: Annotated[str, typer.Argument(help="The quarantined shard ('<model>:<lo>-<hi>[+<scheme>]@<node>').")],
    reason: Annotated[str, typer.Option("--reason", help="Why it may serve again (kept in the event log).")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    db: ReadModelOption = DEFAULT_READ_MODEL,
    nats_url: CommunityNatsOption = None,
) -> None:
    """Let a quarantined shard serve again: publish a signed integrity.quarantine_cleared with the steward's system
    key (DIR/keys/system.nk). Refused, with nothing published, when the read model does not hold it quarantined. Its
    node serves again once none of its shards is quarantined."""
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.events.streams import StreamsMissing
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.protocol.subjects import node_of_shard
    from hearth.services.community_reputation import (
        NotQuarantined,
        ReadModelMissing,
        clear_quarantine,
        quarantined_shards_by_node,
        steward_publisher,
    )
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError

    command = "hearth community clear-quarantine"
    community = Community(directory)
    if not community.system_key_path.is_file():
        fail(f"{community.system_key_path} does not exist: only the steward, with the community's system key, "
              "clears a quarantine", command)
    nats = settings(ctx).nats
    nats = nats.model_copy(update={"url": nats_url or nats.url, "roster_file": community.roster_path})
    try:
        key = community.system_key()
        event = run_event_loop(clear_quarantine(shard_id, reason, db=db, steward_key=key,
                                                publish=steward_publisher(nats, community.system_key_path)))
    except (NotQuarantined, ReadModelMissing, KeyFileError, BrokerUnreachable) as error:
        fail(str(error), command)
    except StreamsMissing as error:
        fail(f"{error}; nothing was changed", command)
    except Exception as error:  # JetStream refused or timed out: say so in one line
        fail(f"the clearing was not published: {error}", command)
    node = node_of_shard(shard_id)
    still = [other for other in quarantined_shards_by_node(db).get(node or "", []) if other != shard_id]
    typer.echo(f"cleared the quarantine of {shard_id} (event {event.event_id}, clearing {event.pipeline_id}); "
               + (f"node {node} stays held (no shard of it is routed) while {', '.join(still)} "
                  f"{'is' if len(still) == 1 else 'are'} quarantined" if still else
                  "routers plan it again once their read model applies it"))


community_app.command("api-key")(api_key_command)
community_app.command("tls")(tls_command)
community_app.command("nats-config")(nats_config_command)
community_app.command("streams")(streams_command)
community_app.command("publish-pending")(publish_pending_command)
