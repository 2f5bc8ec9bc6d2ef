"""`hearth community`: create a community, add members (each with an nkey), list them, and render the NATS
server's authorization block from the roster (`hearth nats`, services/nats_cli.py, runs a broker for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

community_app = typer.Typer(help="Manage a community: its roster, member keys and the broker's permissions.",
                            rich_markup_mode=None,
                            no_args_is_help=True)
DirOption = Annotated[Path, typer.Option("--dir", help="The community folder (roster.json, keys/).")]
DEFAULT_COMMUNITY_DIR = Path("community")
tls_validity_days = 365


def _fail(message: str, command: str = "hearth community") -> None:
    typer.echo(f"{command}: {message}", err=True)
    raise typer.Exit(1)


@community_app.command("init")
def init_command(
    name: Annotated[str, typer.Option("--name", help="The community's name, e.g. 'elm-street'.")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
) -> None:
    """Create a community folder: a roster whose one member is `system`, the steward's own key (keys/system.nk,
    mode 0600), which the broker lets do anything."""
    from trust.community import Community
    from trust.roster import RosterError

    try:
        community = Community.init(directory, name)
    except (RosterError, ValueError) as error:
        _fail(str(error))
    typer.echo(f"created community {name!r} in {directory}: roster {community.roster_path}, "
               f"system key {community.system_key_path} (keep it with the broker; never share it)")


@community_app.command("add")
def add_command(
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
) -> None:
    """Add a member to the roster; then run `hearth community nats-config` and reload the broker."""
    from trust.community import Community
    from trust.keys import KeyFileError
    from trust.roster import ROLES, TRUST_ORDER, RosterError

    if role not in ROLES:
        _fail(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if trust is not None and trust not in TRUST_ORDER:
        _fail(f"--trust must be one of {', '.join(TRUST_ORDER)}, not {trust!r}")
    try:
        added = Community(directory).add(name, role, trust=trust, public_key=public_key)  # type: ignore[arg-type]
    except (RosterError, KeyFileError, ValueError) as error:
        _fail(str(error))
    member = added.member
    where = f"; its key: {added.seed_file} (give it to {name}, then delete it here)" if added.seed_file else ""
    typer.echo(f"added {member.name} as {member.role} ({member.trust}), public key {member.public_key}{where}")


@community_app.command("list")
def list_command(directory: DirOption = DEFAULT_COMMUNITY_DIR) -> None:
    """Print the roster: name, role, trust, public key."""
    from trust.community import Community
    from trust.roster import RosterError

    try:
        roster = Community(directory).roster()
    except RosterError as error:
        _fail(str(error))
    typer.echo(f"community {roster.community!r}: {len(roster.members)} members")
    for member in roster.members:
        typer.echo(f"{member.name:24} {member.role:13} {member.trust:8} {member.public_key}")


@community_app.command("api-key")
def api_key_command(
    name: Annotated[str, typer.Option("--name", help="The member whose calls the key makes (its key must be in "
                                      "DIR/keys/NAME.nk: the gateway signs its calls with it).")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    revoke: Annotated[bool, typer.Option("--revoke", help="Remove every API key of NAME instead.")] = False,
) -> None:
    """Make an API key for `hearth gateway` (printed once; only its SHA-256 is kept, in DIR/api_keys.json, mode
    0600), or revoke a member's keys. Restart the gateway to apply."""
    from services.gateway.keys import ApiKeyError, create_api_key, revoke_api_keys

    try:
        if revoke:
            typer.echo(f"revoked {revoke_api_keys(directory, name)} API keys of {name}", err=True)
            return
        api_key = create_api_key(directory, name)
    except ApiKeyError as error:
        _fail(str(error))
    typer.echo(f"API key for {name} (shown only now; {directory}/api_keys.json keeps its hash):", err=True)
    typer.echo(api_key)


@community_app.command("tls")
def tls_command(
    host: Annotated[list[str], typer.Option("--host", help="A name or address the broker is reached by "
                                            "(repeat); e.g. --host nats --host 192.168.1.10.")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
) -> None:
    """Make a small certificate authority in DIR/tls: a broker certificate for the given hosts and one client
    certificate for the members (for a LAN without a CA of its own; keys mode 0600)."""
    from services.broker.tls import write_throwaway_ca

    if (directory / "tls" / "ca.pem").exists():
        _fail(f"{directory / 'tls'} already holds a CA; not replacing it")
    files = write_throwaway_ca(directory / "tls", tuple(host), validity_days=tls_validity_days)
    typer.echo(f"wrote {files.ca_file}, {files.server_cert_file} (for {', '.join(host)}) and {files.client_cert_file};"
               f" valid {tls_validity_days} days")


@community_app.command("nats-config")
def nats_config_command(
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write to this file (default: stdout).")] = None,
) -> None:
    """Render nats-server's authorization block (one nkey user per member, permissions by role); include it
    in the server's configuration and reload the server (`nats-server --signal reload`)."""
    from services.broker.permissions import refused_members, render_authorization
    from trust.community import Community
    from trust.keys import KeyFileError
    from trust.roster import RosterError

    community = Community(directory)
    try:
        roster = community.roster()
    except (RosterError, KeyFileError) as error:
        _fail(str(error))
    for member in refused_members(roster):
        typer.echo(f"warning: {member.name} ({member.role}, {member.trust}) gets no broker user: only trusted "
                   "or higher may serve shards or orchestrate", err=True)
    text = render_authorization(roster)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)



@community_app.command("streams")
def streams_command(
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: Annotated[Optional[str], typer.Option(
        "--nats", help="The community's broker (default: $HEARTH_NATS_URL or [nats] url; a cluster's URLs "
                       "comma-separated); TLS as [nats] tls_* say.", show_default=False)] = None,
) -> None:
    """Create the event streams on the community's broker, or bring them to the current spec, with the steward's
    system key (DIR/keys/system.nk): on a community broker no other member may. `hearth nats --community` does
    this itself at start; run it for a broker started otherwise (compose.yaml runs it once)."""
    from services.broker.streams import create_community_streams
    from services.common.config import load_settings
    from services.common.lifecycle import run_event_loop
    from services.broker.connection import BrokerUnreachable
    from trust.community import Community

    command = "hearth community streams"
    system_key = Community(directory).system_key_path
    if not system_key.is_file():
        _fail(f"{system_key} does not exist: only the steward, with the community's system key, creates the "
              "streams", command)
    nats = load_settings().nats
    nats = nats.model_copy(update={"url": nats_url or nats.url, "roster_file": Community(directory).roster_path})
    try:
        run_event_loop(create_community_streams(nats, system_key, ready_timeout_s=nats.streams_create_timeout_s))
    except BrokerUnreachable as error:
        _fail(str(error), command)
    except Exception as error:  # JetStream refused or never became ready: say so in one line
        _fail(f"the event streams were not created: {error}", command)
    typer.echo(f"event streams ready on {nats.url}", err=True)
