"""The `hearth community` commands that set up what the broker and the gateway need from the community folder:
API keys (`api-key`), a small certificate authority (`tls`), nats-server's authorization block (`nats-config`) and
the event streams (`streams`); hearth/services/community_cli.py registers them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from hearth.services.cli_options import CommunityNatsOption, settings
from hearth.services.community_cli_options import DEFAULT_COMMUNITY_DIR, DirOption, fail

tls_validity_days = 365


def api_key_command(
    name: Annotated[str, typer.Option("--name", help="The member whose calls the key makes: a client (or system), "
                                      "whose key is in DIR/keys/NAME.nk (the gateway signs its calls with it).")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    revoke: Annotated[bool, typer.Option("--revoke", help="Remove every API key of NAME instead.")] = False,
) -> None:
    """Make an API key for `hearth gateway` (printed once; only its SHA-256 is kept, in DIR/api_keys.json, mode
    0600), or revoke a member's keys. A running gateway applies the change within `[gateway] api_keys_recheck_s`,
    with no restart."""
    from hearth.services.gateway.keys import ApiKeyError, create_api_key, revoke_api_keys

    try:
        if revoke:
            typer.echo(f"revoked {revoke_api_keys(directory, name)} API keys of {name}", err=True)
            return
        api_key = create_api_key(directory, name)
    except ApiKeyError as error:
        fail(str(error))
    typer.echo(f"API key for {name} (shown only now; {directory}/api_keys.json keeps its hash):", err=True)
    typer.echo(api_key)


def tls_command(
    host: Annotated[list[str], typer.Option("--host", help="A name or address the broker is reached by "
                                            "(repeat); e.g. --host nats --host 192.168.1.10.")],
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    replace: Annotated[bool, typer.Option("--replace", help="DIR/tls holds a CA already (its certificates end soon, "
                                          "or a key leaked): move it aside to DIR/tls.replaced-<time> and make a new "
                                          "one.")] = False,
) -> None:
    """Make a small certificate authority in DIR/tls: a broker certificate for the given hosts and one client
    certificate for the members (for a LAN without a CA of its own; every file mode 0600, the folder 0700)."""
    from hearth.services.broker.tls import TlsConfigError, certificate_host_name, write_throwaway_ca

    try:  # before the previous CA is moved aside: a mistyped host leaves it in place
        for name in host:
            certificate_host_name(name)
    except TlsConfigError as error:
        fail(f"--host: {error}")
    aside = None
    if (directory / "tls" / "ca.pem").exists():
        if not replace:
            fail(f"{directory / 'tls'} already holds a CA; not replacing it (--replace moves it aside)")
        aside = directory / f"tls.replaced-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            (directory / "tls").rename(aside)
        except OSError as error:
            fail(f"cannot move {directory / 'tls'} aside: {error.strerror}")
    try:
        files = write_throwaway_ca(directory / "tls", tuple(host), validity_days=tls_validity_days)
    except TlsConfigError as error:
        fail(f"--host: {error}")
    except OSError as error:
        kept = f" (the previous CA is in {aside})" if aside is not None else ""
        fail(f"cannot write {directory / 'tls'}: {error.strerror}{kept}")
    if aside is not None:
        typer.echo(f"moved the previous CA to {aside}", err=True)
    typer.echo(f"wrote {files.ca_file}, the broker's {files.server_cert_file} and {files.server_key_file} (for "
               f"{', '.join(host)}; hearth nats --tls-cert, --tls-key, --tls-ca) and the members' "
               f"{files.client_cert_file} and {files.client_key_file}; valid {tls_validity_days} days. Copy "
               f"{files.ca_file.name}, {files.client_cert_file.name} and {files.client_key_file.name} to every "
               "member's machine and set [nats] tls_ca_file, tls_cert_file and tls_key_file to them (never the "
               "server's key)")


def nats_config_command(
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write to this file (default: stdout).")] = None,
) -> None:
    """Render nats-server's authorization block (one nkey user per member, permissions by role); include it
    in the server's configuration and reload the server (`nats-server --signal reload`)."""
    from hearth.services.broker.permissions import refused_members, render_authorization
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import RosterError

    community = Community(directory)
    try:
        roster = community.roster()
    except (RosterError, KeyFileError) as error:
        fail(str(error))
    for member in refused_members(roster):
        typer.echo(f"warning: {member.name} ({member.role}, {member.trust}) gets no broker user: only trusted "
                   "or higher may serve shards or orchestrate", err=True)
    text = render_authorization(roster)
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.write_text(text)
    except OSError as error:
        fail(f"cannot write {out}: {error.strerror}")
    typer.echo(f"wrote {out}", err=True)


def streams_command(
    ctx: typer.Context,
    directory: DirOption = DEFAULT_COMMUNITY_DIR,
    nats_url: CommunityNatsOption = None,
) -> None:
    """Create the event streams and the orchestrators' call-nonce bucket on the community's broker, or bring them to
    the current spec, with the steward's system key (DIR/keys/system.nk): on a community broker no other member may;
    and bound the weights bucket to [weights] max_store_mb when set. `hearth nats --community` does this itself at
    start; run it for a broker started otherwise (compose.yaml runs it once)."""
    from hearth.services.broker.streams import create_community_streams
    from hearth.services.broker.weights_bucket import WeightsBucketError, shown_size, weights_bucket_bound_bytes
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.services.broker.connection import BrokerUnreachable
    from hearth.trust.community import Community

    command = "hearth community streams"
    system_key = Community(directory).system_key_path
    if not system_key.is_file():
        fail(f"{system_key} does not exist: only the steward, with the community's system key, creates the "
              "streams", command)
    nats = settings(ctx).nats
    nats = nats.model_copy(update={"url": nats_url or nats.url, "roster_file": Community(directory).roster_path})
    weights_max_bytes = weights_bucket_bound_bytes(settings(ctx).weights)  # the store's size is not known here
    try:
        run_event_loop(create_community_streams(nats, system_key, ready_timeout_s=nats.streams_create_timeout_s,
                                                weights_max_bytes=weights_max_bytes))
    except (BrokerUnreachable, WeightsBucketError) as error:
        fail(str(error), command)
    except Exception as error:  # JetStream refused or never became ready: say so in one line
        fail(f"the event streams were not created: {error}", command)
    bound = ("; the weights store's bound is left as it is ([weights] max_store_mb unset)" if weights_max_bytes is None
             else f"; the weights store may hold {shown_size(weights_max_bytes)}")
    typer.echo(f"event streams ready on {nats.url}{bound}", err=True)
