"""`hearth nats`: runs the broker: one nats-server, `--cluster N` clustered ones on this machine, or `--node NAME`,
one node of a cluster spread over machines or containers (compose.yaml); open, or for a community (its members'
permissions and TLS)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from hearth.services.cli_options import settings
from hearth.services.common.config_sections import loopback_host, max_tcp_port
from hearth.services.common.hearth_files import state_dir

if TYPE_CHECKING:
    import threading

    from hearth.services.broker.consumer_sweep import ConsumerSweeper
    from hearth.services.broker.server import EmbeddedNatsServer
    from hearth.services.common.config import NatsSettings

COMMAND = "hearth nats"
# After nats-server refused a changed roster, it is tried again this long later (or when the roster changes again).
reload_retry_s = 30.0
NATS_HELP_EPILOG = (
    "A cluster: `hearth nats --cluster 3` runs three nodes here (client ports PORT, PORT+1, PORT+2; cluster ports "
    "from --cluster-port; stores STORE/nats-0..2) and prints their URLs comma-separated, which --nats and "
    "HEARTH_NATS_URL take as they are. Each node runs nats/hearth-cluster.conf; the event streams then keep three "
    "copies, and losing one node loses no acknowledged event. SIGINT/SIGTERM stops every node."
)


def default_store(port: int) -> Path:
    """Where `hearth nats` keeps JetStream data without --store: in hearth's state folder, so that a restart from
    another folder finds its streams, and per client port, so that two brokers on one machine never share one."""
    return state_dir(f"nats-{port}")


def _fail(message: str) -> None:
    typer.echo(f"{COMMAND}: {message}", err=True)
    raise typer.Exit(1)


def _authorization(community: Path | None) -> str | None:
    if community is None:
        return None
    from hearth.services.broker.permissions import render_authorization
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError
    from hearth.trust.roster import RosterError

    try:
        return render_authorization(Community(community).roster())
    except (RosterError, KeyFileError) as error:
        _fail(str(error))


def _route_password(community: Path | None) -> str | None:
    """The community's route password (None: a random one; only nodes started together can share it)."""
    if community is None:
        return None
    from hearth.services.broker.cluster import community_route_password
    from hearth.trust.community import Community
    from hearth.trust.keys import KeyFileError

    try:
        return community_route_password(Community(community))
    except KeyFileError as error:
        _fail(f"the cluster's route password comes from the community's system key: {error}")


def _tls_block(tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None) -> str | None:
    if (tls_cert is None) != (tls_key is None) or (tls_ca is not None and tls_cert is None):
        _fail("TLS needs --tls-cert and --tls-key (and --tls-ca only with them)")
    if tls_cert is None:
        return None
    from hearth.services.broker.tls import server_tls_block

    _check_certificate_dates([tls_cert, *([tls_ca] if tls_ca else [])])
    return server_tls_block(tls_cert, tls_key, tls_ca)


def _check_certificate_dates(files: list[Path]) -> None:
    """Refuse a broker certificate that has ended or not begun (every member's handshake would fail, each saying
    only that the handshake failed); warn of one that ends soon."""
    import datetime

    from hearth.services.broker.tls import certificate_dates

    now = datetime.datetime.now(datetime.timezone.utc)
    dates = certificate_dates(files, now)
    if dates is None:
        return
    state, said = dates.judged(now)
    renew = "make new ones: hearth community tls --replace --host HOST ..."
    if state == "ended":
        _fail(f"{said}: every member's TLS handshake would fail; {renew}")
    if state == "not_begun":
        _fail(f"{said}: set the clock right (NTP) or use the current certificates")
    if state == "ends_soon":
        typer.echo(f"{COMMAND}: warning: {said}; {renew}", err=True)


def nats_command(
    ctx: typer.Context,
    port: Annotated[int, typer.Option("--port", min=1, max=max_tcp_port,
                                      help="Client port to listen on (the first node's, with --cluster).")] = 4222,
    store: Annotated[Optional[Path], typer.Option(
        "--store", show_default=False,
        help="Directory for JetStream data, kept across restarts (default: nats-PORT in hearth's state folder, "
             "$XDG_STATE_HOME/hearth, else ~/.local/state/hearth: the same whatever folder it starts from).")]
    = None,
    host: Annotated[
        str, typer.Option("--host", help="Interface to listen on; 0.0.0.0 to accept other machines.")
    ] = loopback_host,
    community: Annotated[Optional[Path], typer.Option(
        "--community", help="Community folder: only its members may connect, each with its role's permissions "
                            "(rendered from its roster, as `hearth community nats-config` does).")] = None,
    tls_cert: Annotated[Optional[Path], typer.Option("--tls-cert", help="Serve TLS only, with this certificate "
                                                     "(PEM; with --tls-key).")] = None,
    tls_key: Annotated[Optional[Path], typer.Option("--tls-key", help="The certificate's private key (PEM).")] = None,
    tls_ca: Annotated[Optional[Path], typer.Option("--tls-ca", help="Verify client certificates against this CA "
                                                   "(PEM); members then need [nats] tls_cert_file too.")] = None,
    cluster: Annotated[Optional[int], typer.Option(
        "--cluster", min=3, show_default=False,
        help="Run this many clustered nodes on this machine (3 or more) and print their URLs comma-separated.")]
    = None,
    node: Annotated[Optional[str], typer.Option(
        "--node", show_default=False,
        help="Run one node of a cluster whose other nodes run elsewhere (compose.yaml): its name, unique in the "
             "cluster; needs --routes and --community (the route password derives from its system key).")] = None,
    routes: Annotated[Optional[str], typer.Option(
        "--routes", show_default=False,
        help="With --node: every node's cluster address, this one's included, comma-separated "
             "(nats-0:6222,nats-1:6222,nats-2:6222).")] = None,
    cluster_port: Annotated[int, typer.Option(
        "--cluster-port", min=1, max=max_tcp_port,
        help="Port the nodes connect to each other on (with --cluster: the first node's).")]
    = 6222,
    monitor_port: Annotated[int, typer.Option(
        "--monitor-port", min=1, max=max_tcp_port,
        help="A node's monitoring port on 127.0.0.1: /healthz, /jsz, /routez (with --cluster: the first node's).")]
    = 8222,
    check: Annotated[bool, typer.Option(
        "--check", help="Write the configuration, have nats-server test it (-t) and exit: 0 when it is valid.")]
    = False,
) -> None:
    """Run nats-server with JetStream (fsync on every write) until SIGINT/SIGTERM: one server, or a cluster."""
    from hearth.services.broker.cluster import ClusterNodeServer, EmbeddedNatsCluster
    from hearth.services.broker.server import EmbeddedNatsServer, NatsServerError
    from hearth.services.broker.weights_bucket import weights_bucket_bound_bytes

    stop_requested = _stop_on_signals()  # from now on: a stop while the servers start lets them start, then stops
    store = store if store is not None else default_store(port)
    if cluster is not None and node is not None:
        _fail("give --cluster (every node here) or --node (one node), not both")
    if (node is None) != (routes is None):
        _fail("--node and --routes go together")
    if cluster is not None and max(port, cluster_port, monitor_port) + cluster - 1 > max_tcp_port:
        _fail(f"--cluster {cluster} numbers its nodes' ports up from --port, --cluster-port and --monitor-port: "
              f"each must leave {cluster - 1} ports above it below {max_tcp_port + 1}")
    if node is not None and community is None:
        _fail("--node needs --community: the nodes' route password derives from the community's system key")
    # Read before any server starts: a configuration the steward's tooling cannot use is refused with nothing running.
    nats_settings = None if community is None else settings(ctx).nats
    weights_settings = None if community is None else settings(ctx).weights
    server_options = dict(host=host, authorization=_authorization(community),
                          tls_block=_tls_block(tls_cert, tls_key, tls_ca))
    if cluster is not None:
        servers = EmbeddedNatsCluster(
            cluster, store_dir=store, ports=[port + i for i in range(cluster)],
            cluster_ports=[cluster_port + i for i in range(cluster)],
            monitor_ports=[monitor_port + i for i in range(cluster)],
            route_password=_route_password(community), **server_options)
    elif node is not None:
        route_list = [route.strip() for route in routes.split(",") if route.strip()]
        servers = ClusterNodeServer(name=node, routes=route_list, route_password=_route_password(community),
                                    cluster_listen=f"{host}:{cluster_port}", monitor_port=monitor_port, port=port,
                                    store_dir=store, **server_options)
    else:
        servers = EmbeddedNatsServer(port=port, store_dir=store, **server_options)
    roster_watch = None if community is None else _roster_watch(community, server_options["authorization"])
    try:
        if check:
            servers.check_config()
            typer.echo(f"{COMMAND}: configuration valid", err=True)
            return
        servers.start()
    except NatsServerError as error:
        _fail(str(error))
    if community is None:  # as every member process run with --insecure warns at each start
        import logging

        logging.getLogger("hearth").warning(
            "%s: an open broker (no --community): anyone who reaches %s can read prompts and activations and forge "
            "routing", COMMAND, servers.url)
    sweeper = None
    if community is not None:
        steward = _steward_settings(nats_settings, servers, community, tls=tls_cert is not None)
        if steward is not None:
            _create_streams(steward, community, one_node=node is not None,
                            weights_max_bytes=weights_bucket_bound_bytes(weights_settings, servers.store_bound))
            sweeper = _consumer_sweeper(steward, community)
    typer.echo(servers.url)
    typer.echo(f"JetStream store: {store.resolve()}  (Ctrl-C to stop)", err=True)
    _serve_until_stopped(servers, stop_requested, roster_watch, sweeper)


class RosterWatch:
    """Applies a community's changed roster to the running broker: a member added may connect within a second,
    a member removed has its connections closed by nats-server. A roster that does not read keeps the last one; a
    reload nats-server refuses is said at once and tried again when the roster changes or `reload_retry_s` later."""

    def __init__(self, community: Path, applied_authorization: str | None) -> None:
        from hearth.events.signing import RosterFile
        from hearth.trust.community import Community

        self.roster_file = RosterFile(Community(community).roster_path, recheck_interval_s=0.0)
        self.applied_authorization = applied_authorization
        self._applied_roster = None  # the first look renders it again: the file may have changed since
        self._applied_names = {member.name for member in self.roster_file.current().members}
        self._failed: tuple[object, float] | None = None  # (the roster whose reload failed, when)

    def apply_changes(self, servers: "EmbeddedNatsServer") -> None:
        import time

        from hearth.services.broker.permissions import admitted, render_authorization
        from hearth.services.broker.server import NatsServerError

        roster = self.roster_file.current()
        if roster is self._applied_roster:
            return
        if self._failed is not None and self._failed[0] is roster and time.monotonic() < self._failed[1]:
            return
        authorization = render_authorization(roster)
        if authorization != self.applied_authorization:
            try:
                servers.reload(authorization)
            except NatsServerError as error:  # it keeps serving with the roster it had
                self._failed = (roster, time.monotonic() + reload_retry_s)
                still_in = sorted(self._applied_names - {member.name for member in roster.members})
                pending = f"; still admitted though removed: {', '.join(still_in)}" if still_in else ""
                typer.echo(f"{COMMAND}: the changed roster was not applied ({error}){pending}; tried again when "
                           f"the roster changes or in {reload_retry_s:g} s", err=True)
                return
            typer.echo(f"{COMMAND}: roster changed; the broker now admits "
                       f"{sum(admitted(member) for member in roster.members)} of its {len(roster.members)} members",
                       err=True)
        self.applied_authorization, self._applied_roster, self._failed = authorization, roster, None
        self._applied_names = {member.name for member in roster.members}


def _roster_watch(community: Path, authorization: str | None) -> RosterWatch:
    from hearth.trust.roster import RosterError

    try:
        return RosterWatch(community, authorization)
    except RosterError as error:
        _fail(str(error))


def _steward_settings(nats_settings: "NatsSettings", servers: "EmbeddedNatsServer", community: Path, *,
                      tls: bool) -> "NatsSettings | None":
    """How the steward's own tooling reaches this broker (None, said why, when it cannot: TLS without a CA)."""
    from hearth.trust.community import Community

    if tls and nats_settings.tls_ca_file is None:
        typer.echo(f"{COMMAND}: no [nats] tls_ca_file to reach this TLS broker with: create the event streams with "
                   f"`hearth community streams --dir {community} --nats URL`; consumers that deliver elsewhere than "
                   "their member's inbox are not swept", err=True)
        return None
    return nats_settings.model_copy(update={"url": servers.url, "roster_file": Community(community).roster_path})


def _create_streams(steward: "NatsSettings", community: Path, *, one_node: bool,
                    weights_max_bytes: int | None) -> None:
    """The event streams, created with the community's system key: no other member may administer them; then the
    weights bucket's bound."""
    from hearth.services.broker.streams import create_community_streams_blocking
    from hearth.services.broker.weights_bucket import WeightsBucketError, shown_size
    from hearth.trust.community import Community

    later = f"create them with `hearth community streams --dir {community} --nats URL`"
    if one_node:  # the cluster's other nodes may not be up yet: JetStream has no quorum
        typer.echo(f"{COMMAND}: the event streams need the whole cluster; {later} once every node runs", err=True)
        return
    try:
        create_community_streams_blocking(steward, Community(community).system_key_path,
                                          ready_timeout_s=steward.streams_create_timeout_s,
                                          weights_max_bytes=weights_max_bytes)
    except WeightsBucketError as error:  # the event streams are in place
        typer.echo(f"{COMMAND}: event streams ready; {error}", err=True)
        return
    except Exception as error:  # the broker still serves; the streams can be created later
        typer.echo(f"{COMMAND}: the event streams were not created ({error}); {later}", err=True)
        return
    bound = "" if weights_max_bytes is None else f"; the weights store may hold {shown_size(weights_max_bytes)}"
    typer.echo(f"{COMMAND}: event streams ready{bound}", err=True)


def _consumer_sweeper(steward: "NatsSettings", community: Path) -> "ConsumerSweeper":
    """Deletes, as the steward, consumers of the community's streams that deliver elsewhere than a reader's inbox."""
    from hearth.services.broker.consumer_sweep import ConsumerSweeper
    from hearth.protocol.display_text import display_text
    from hearth.trust.community import Community

    def report(swept) -> None:
        typer.echo(display_text(f"{COMMAND}: deleted consumer {swept.name} of {swept.stream}: {swept.why}"), err=True)

    community_files = Community(community)
    sweeper = ConsumerSweeper(steward, community_files.system_key_path, community_files.roster_path,
                              report=report).start()
    if not sweeper.watching.wait(steward.connect_timeout_s):  # it goes on trying; consumers are swept once it runs
        typer.echo(f"{COMMAND}: the consumer sweep has not connected yet; a consumer created before it does is "
                   "swept then, its creator unnamed", err=True)
    return sweeper


def _stop_on_signals() -> "threading.Event":
    import signal
    import threading

    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_requested.set())
    return stop_requested


def _serve_until_stopped(servers: "EmbeddedNatsServer", stop_requested: "threading.Event",
                         roster_watch: RosterWatch | None, sweeper: "ConsumerSweeper | None") -> None:
    from hearth.services.broker.store_space import FullStoreWatch
    from hearth.services.common.process_gc import freeze_startup_objects

    freeze_startup_objects()  # it serves without an event loop, whose start would do it (process_gc.py)
    exit_code = 0
    store_watches = [FullStoreWatch(node) for node in getattr(servers, "nodes", [servers])]
    try:
        while not stop_requested.wait(timeout=0.5):
            for store_watch in store_watches:  # before the liveness check: a restart it makes is no exit
                store_watch.check()
            # A terminal's Ctrl-C reaches nats-server too; that exit is a requested stop, not a crash.
            if not servers.is_running() and not stop_requested.wait(timeout=0.5):
                typer.echo(f"{COMMAND}: nats-server exited unexpectedly", err=True)
                exit_code = 1
                break
            if roster_watch is not None:
                roster_watch.apply_changes(servers)
    finally:
        if sweeper is not None:  # before the broker goes, so its last sweep ends cleanly
            sweeper.stop()
        servers.stop()
    if exit_code:
        raise typer.Exit(exit_code)
