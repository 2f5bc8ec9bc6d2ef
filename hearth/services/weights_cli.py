"""`hearth weights`: publish a checkpoint into the community's object store, list what is stored and the room left,
remove a model, prefetch a part.

The bodies live in hearth/services/weights_store.py and weights_publish.py (imported when a command runs, so
`hearth` starts without torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hearth.services.cli_options import EXIT_BAD_INPUT, CredsOption, InsecureOption, NatsUrlOption, resolve_nats_url, \
    settings, use_credentials

weights_app = typer.Typer(help="The community's checkpoints in the NATS object store, stored per layer "
                               "(load one with --model store:NAME).", rich_markup_mode=None, no_args_is_help=True)


def _fail(command: str, message: str) -> None:
    typer.echo(f"hearth weights {command}: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _run(ctx: typer.Context, command: str, nats_url: str | None, work):
    """Connect, run `work(js)`, close; one line and exit code 2 on bad input, an unreachable broker or one that
    refuses this member's key."""
    from hearth.services.broker.connection import BrokerUnreachable, connect_nats
    from hearth.services.common.lifecycle import run_event_loop
    from hearth.services.weights_store import WeightsStoreError, refusals_told

    url = resolve_nats_url(ctx, nats_url)
    nats_settings = settings(ctx).nats  # read (or refused) before the event loop runs

    async def session():
        nc = await connect_nats(url, name=f"hearth weights {command}", settings=nats_settings)
        try:
            return await refusals_told(nc, work(nc.jetstream()))
        finally:
            await nc.close()

    try:
        return run_event_loop(session())
    except (WeightsStoreError, BrokerUnreachable) as error:  # their messages say it all
        _fail(command, str(error))
    except Exception as error:  # broker refusals and timeouts: one line, not a traceback
        _fail(command, f"{type(error).__name__}: {error}")


def _parse_part(part: str):
    if part in ("all", "head"):
        return None if part == "all" else "head"
    lo, _, hi = part.partition("-")
    if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
        raise typer.BadParameter("give LO-HI (e.g. 0-11), head or all")
    return int(lo), int(hi)


@weights_app.command("publish")
def publish_command(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="A safetensors checkpoint folder (config.json, *.safetensors), a "
                                             "GGUF file, a folder holding one GGUF, or ollama:NAME[:TAG] (a model "
                                             "Ollama pulled onto this machine).")],
    name: Annotated[str, typer.Option("--name", help="The name members load it by: --model store:NAME.")],
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Store a checkpoint per layer (plus head and tokenizer files and a manifest with each object's SHA-256; a
    GGUF keeps its block types, its metadata stored as one header object), within the store's bound ([weights]
    max_store_mb): one it has no room for is refused before anything is stored. On a community mesh only the
    steward's `system` key may write the store."""
    from hearth.services.broker.weights_bucket import weights_bucket_bound_bytes
    from hearth.services.weights_publish import check_publishable, publish_checkpoint
    from hearth.services.weights_store import WeightsStoreError

    path = path.expanduser()  # as --model takes a path: one quoted for its spaces keeps its "~"
    try:
        check_publishable(path)
    except WeightsStoreError as error:
        _fail("publish", str(error))
    use_credentials(ctx, "hearth weights publish", creds, insecure)
    max_store_bytes = weights_bucket_bound_bytes(settings(ctx).weights)
    manifest = _run(ctx, "publish", nats_url,
                    lambda js: publish_checkpoint(js, path, name, max_store_bytes=max_store_bytes))
    typer.echo(f"published {name}: {manifest.num_layers} layers in {len(manifest.objects)} objects, weights "
               f"{manifest.weights_sha256[:12]}; load it with --model store:{name}")


@weights_app.command("list")
def list_command(
    ctx: typer.Context,
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """The models in the community's store: name, layers, size, weights digest (or why its manifest is unreadable);
    then, on stderr, what the store holds and the room it has left."""
    from hearth.services.broker.weights_bucket import bucket_room, shown_size
    from hearth.protocol.display_text import display_text
    from hearth.services.weights_store import list_models

    async def listing(js):
        return await list_models(js), await bucket_room(js)

    use_credentials(ctx, "hearth weights list", creds, insecure)
    models, room = _run(ctx, "list", nats_url, listing)
    models_bytes = 0
    for name, manifest in models:
        if isinstance(manifest, Exception):
            typer.echo(f"{display_text(name)}\tunreadable: {display_text(str(manifest))}")
            continue
        size = sum(stored.size for stored in manifest.objects)
        models_bytes += size
        typer.echo(f"{display_text(manifest.name)}\t{manifest.num_layers} layers\t{shown_size(size)}\t"
                   f"{manifest.weights_sha256[:12]}")
    if room is not None:  # None: the bucket was deleted since its models were listed
        typer.echo(_room_line(models_bytes, room), err=True)


def _room_line(models_bytes: int, room) -> str:
    from hearth.services.broker.weights_bucket import WHERE_THE_BOUND_COMES_FROM, shown_size

    held = f"weights store: models {shown_size(models_bytes)}, {shown_size(room.held)} held"
    if room.bound is None:
        return f"{held}, no bound: publishing is refused until it has one ({WHERE_THE_BOUND_COMES_FROM})"
    return f"{held} of {shown_size(room.bound)}, {shown_size(room.free)} free"


@weights_app.command("remove")
def remove_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The stored model: NAME, or store:NAME as --model names it.")],
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Remove a stored model: its manifest first (no host starts fetching it afterwards), then every object stored
    under its name, an interrupted publication's too, but a publication's under way (objects stored within a day that
    no manifest names yet: it ends publishing the name again). Hosts serving it from their cache go on, and each
    host's copy stays until `hearth cache clear store NAME` there. On a community mesh only the steward's `system`
    key may."""
    from hearth.services.broker.weights_bucket import shown_size
    from hearth.services.weights_publish import remove_model
    from hearth.services.weights_store import STORE_MODEL_PREFIX

    name = name.removeprefix(STORE_MODEL_PREFIX)  # the name checked where it is removed
    use_credentials(ctx, "hearth weights remove", creds, insecure)
    removed = _run(ctx, "remove", nats_url, lambda js: remove_model(js, name))
    typer.echo(f"removed {name}: {removed.objects} objects, {shown_size(removed.size)} freed")
    if removed.left_under_way:
        typer.echo(f"left {removed.left_under_way} objects of a publication of {name} under way (stored within the "
                   "last day, named by no manifest yet): when it ends, the store holds that publication; if it was "
                   "stopped, the next publication of the name removes them once a day old")


@weights_app.command("fetch")
def fetch_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The stored model: NAME, or store:NAME as --model names it.")],
    part: Annotated[str, typer.Option("--part", help="LO-HI (layers, inclusive), head, or all.")] = "all",
    nats_url: NatsUrlOption = None,
    creds: CredsOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Fetch (ahead of `hearth shard --model store:NAME`) what a part needs into the local cache; prints the folder."""
    from hearth.services.weights_store import STORE_MODEL_PREFIX, fetch_stored_model

    needed = _parse_part(part)
    name = name.removeprefix(STORE_MODEL_PREFIX)  # the name checked where it is fetched
    use_credentials(ctx, "hearth weights fetch", creds, insecure)
    typer.echo(_run(ctx, "fetch", nats_url, lambda js: fetch_stored_model(js, name, needed)))
