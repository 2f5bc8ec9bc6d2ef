"""`hearth gateway`: connect to the mesh, load the API keys, and serve the gateway's ASGI app with uvicorn until
SIGINT/SIGTERM (services.common.lifecycle handles the signals, not uvicorn)."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

from hearth.services.common.config_sections import max_tcp_port
from hearth.services.cli_options import (
    READY_FILE_HELP,
    CredsOption,
    InsecureOption,
    MetricsHostOption,
    MetricsPortOption,
    NatsUrlOption,
    WaitForNatsOption,
    checked_ready_file,
    long_running,
    resolve_nats_url,
    settings,
    use_credentials,
    use_metrics_host,
    wait_for_nats,
)

log = logging.getLogger(__name__)
startup_poll_s = 0.01
# Where `hearth demo --serve` puts its gateway when the port is free (else any free port).
demo_gateway_port = 8000


def community_of(creds_file: Path | None) -> Path | None:
    """The community folder a key in `community/keys/` belongs to (the layout `hearth community` writes)."""
    from hearth.services.common.identity import default_roster_for

    roster = default_roster_for(creds_file) if creds_file is not None else None
    return roster.parent if roster is not None else None


def api_keys_folder(community: Path | None, hearth_settings, *, on_community_mesh: bool) -> Path | None:
    """The community folder whose api_keys.json the gateway serves: `--community`, else [gateway] community_dir,
    else the folder of the member key it logs in with; None on an open mesh. ValueError (one line) when a community
    mesh has none, or an open one was given one."""
    configured = community or hearth_settings.gateway.community_dir
    if not on_community_mesh:
        if configured is not None:
            # API keys sign calls with their members' keys: on an open mesh there is nothing to check them against,
            # and serving without them while the operator asked for them would let anyone in unnoticed.
            raise ValueError("--community (or [gateway] community_dir) asks for API keys, which an open mesh "
                             "(--insecure) does not use: give --creds instead of --insecure, or leave out the "
                             "community")
        return None
    found = configured or community_of(hearth_settings.nats.creds_file)
    if found is None:
        raise ValueError("on a community mesh API keys are needed: give --community DIR (with api_keys.json from "
                         "`hearth community api-key`)")
    return found


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A bound, listening socket (port 0: any free one); CommandRefused when the address cannot be had."""
    from hearth.services.common.lifecycle import CommandRefused

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as error:
        raise CommandRefused(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


async def run_gateway(hearth_settings, nats_url: str, *, community_dir: Path | None, sock: socket.socket,
                      ready_file: Path | None, stop_event: asyncio.Event, metrics_port: int = 0) -> None:
    from hearth.services.common.lifecycle import CommandRefused, unless_stopped, write_ready_file
    from hearth.services.common.metrics import serve_process_metrics
    from hearth.services.broker.connection import connect_nats, drain_or_close
    from hearth.services.gateway.app import create_app
    from hearth.services.gateway.http_server import GatewayHttpServer, server_config, stop_serving
    from hearth.services.gateway.keys import ApiKeyError, WatchedApiKeyring
    from hearth.services.gateway.mesh import Gateway

    keyring = None
    if community_dir is not None:
        try:
            keyring = WatchedApiKeyring(community_dir, recheck_s=hearth_settings.gateway.api_keys_recheck_s)
        except ApiKeyError as error:
            raise CommandRefused(str(error)) from None
    nc = await unless_stopped(connect_nats(nats_url, name="hearth-gateway", settings=hearth_settings.nats), stop_event)
    gateway_settings = hearth_settings.gateway
    gateway = Gateway(nc, hearth_settings, keyring)
    server = GatewayHttpServer(server_config(create_app(gateway), gateway_settings))
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    metrics_server = None
    try:
        metrics_server = serve_process_metrics(metrics_port, "gateway", host=hearth_settings.metrics.host)
        while not server.started:
            if serving.done():
                serving.result()
                raise CommandRefused("the HTTP server stopped while starting")
            await asyncio.sleep(startup_poll_s)
        url = base_url(sock)
        who = (f"API keys of {', '.join(keyring.members) or 'nobody'}" if keyring is not None
               else "no API key: open mesh")
        print(f"hearth gateway: OPENAI_BASE_URL={url}/v1 ({who})", flush=True)
        if ready_file is not None:
            write_ready_file(ready_file, url)
        stopping = asyncio.ensure_future(stop_event.wait())
        await asyncio.wait((stopping, serving), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        await stop_serving(server, serving, gateway_settings.shutdown_grace_s, gateway.stops.stop)
        await drain_or_close(nc, hearth_settings.nats.drain_timeout_s)


@long_running("hearth gateway")
def gateway_command(
    ctx: typer.Context,
    host: Annotated[Optional[str], typer.Option("--host", help="Interface to listen on (default: [gateway] host, "
                                                "127.0.0.1); 0.0.0.0 to accept other machines.",
                                                show_default=False)] = None,
    port: Annotated[Optional[int], typer.Option("--port", min=0, max=max_tcp_port, help="TCP port (default: [gateway] "
                                                "port, 8000; 0: any free port).", show_default=False)] = None,
    community: Annotated[Optional[Path], typer.Option(
        "--community", help="Community folder with api_keys.json (`hearth community api-key`) and the keys of the "
                            "members it names; default: [gateway] community_dir, else the folder of --creds.",
        show_default=False)] = None,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
    ready_file: Annotated[Optional[Path], typer.Option(
        "--ready-file", callback=checked_ready_file, show_default=False,
        help=f"Write the gateway's base URL to this file once it serves: {READY_FILE_HELP}.")] = None,
    wait_for_nats_flag: WaitForNatsOption = False,
    metrics_port: MetricsPortOption = 0,
    metrics_host: MetricsHostOption = None,
) -> None:
    """Serve an OpenAI-compatible HTTP API (Starlette on uvicorn) in front of the mesh: /v1/models,
    /v1/chat/completions, /v1/completions (streamed as server-sent events or not), /healthz; /metrics on its own
    port (--metrics-port).

    On a community mesh every call needs an API key (Authorization: Bearer KEY) of a member, and is signed
    with that member's key; with --insecure (an open mesh) no key is asked for, and anyone who reaches the port
    (all of a LAN with --host 0.0.0.0) calls with no per-member limit."""
    from hearth.services.common.lifecycle import run_until_stopped

    wait_for_nats(ctx, wait_for_nats_flag)
    use_metrics_host(ctx, metrics_host)
    identity = use_credentials(ctx, "hearth gateway", creds, insecure)
    hearth_settings = settings(ctx)
    try:
        community_dir = api_keys_folder(community, hearth_settings, on_community_mesh=identity is not None)
    except ValueError as error:
        typer.echo(f"hearth gateway: {error}", err=True)
        raise typer.Exit(1) from None
    gateway_settings = hearth_settings.gateway
    sock = listening_socket(host or gateway_settings.host, gateway_settings.port if port is None else port,
                            gateway_settings.listen_backlog)
    url = resolve_nats_url(ctx, nats_url)
    run_until_stopped(lambda stop_event: run_gateway(hearth_settings, url, community_dir=community_dir, sock=sock,
                                                     ready_file=ready_file, stop_event=stop_event,
                                                     metrics_port=metrics_port))


def start_demo_gateway(cluster, member: str, model_id: str, *, chat: bool) -> list[str]:
    """`hearth demo --serve`: a gateway in front of the demo's mesh with an API key for `member`; the lines to
    paste (OPENAI_BASE_URL and a `curl -N` call)."""
    import json
    import shlex

    from hearth.services.gateway.keys import create_api_key

    api_key = create_api_key(cluster.community.directory, member)
    port = demo_gateway_port if _port_is_free(demo_gateway_port) else 0
    url = cluster.start_gateway(extra_args=["--port", str(port)]).ready_file.read_text()
    if chat:
        path, body = "chat/completions", {"messages": [{"role": "user", "content": "Tell me a joke."}]}
    else:
        path, body = "completions", {"prompt": "Tell me a joke."}
    body = {"model": model_id, **body, "max_tokens": 48, "stream": True}
    return [f"OpenAI-compatible gateway: export OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY={api_key}",
            f"Try:  curl -N {url}/v1/{path} -H 'Authorization: Bearer {api_key}' "
            f"-H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"]


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
