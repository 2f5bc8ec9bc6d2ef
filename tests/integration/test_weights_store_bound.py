"""The weights bucket's bound, against a real nats-server: the event streams keep the room they reserve whatever is
published, a checkpoint the bucket has no room for is refused before anything is stored, a publication cut short by a
full store leaves nothing of itself, a reader of an object missing chunks is told it is incomplete, and a model
removed gives its room back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from typer.testing import CliRunner

from hearth.events import streams
from hearth.services.broker import server as server_module
from hearth.services.broker.permissions import WEIGHTS_BUCKET, WEIGHTS_STREAM
from hearth.services.broker.store_space import MiB, streams_reserve_bytes
from hearth.services.broker.streams import create_community_streams
from hearth.services.broker.weights_bucket import bucket_room, weights_bucket_bound_bytes
from hearth.services.common import call_nonces
from hearth.services.common.config import NatsSettings, WeightsSettings
from hearth.services.weights_objects import ObjectIncomplete, put_new_object
from hearth.services.weights_publish import publish_checkpoint
from hearth.services.weights_store import LAYER_OBJECT_FORMAT, OBJECT_CHUNK_BYTES, WeightsStoreError, \
    fetch_stored_model, list_models, object_key
from tests.integration.test_weights_store import NAME, _member_js, _same_parameters
from tests.integration.test_weights_store import js, published  # noqa: F401  (fixtures)
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

# What the event streams and the call-nonce bucket reserve here (1.5 GiB in earnest), and the room the store has
# beyond it: room for three tiny checkpoints in the bucket's share.
STREAM_RESERVE_BYTES = 1 * MiB
STORE_ROOM_BYTES = 4 * MiB
EVENT = b"e" * (16 * 1024)


@pytest.fixture
def small_store(tmp_path, monkeypatch):
    """A community broker whose store is bounded to what its streams reserve plus STORE_ROOM_BYTES."""
    from hearth.services.broker.permissions import render_authorization
    from hearth.services.broker.server import EmbeddedNatsServer
    from hearth.trust.community import Community

    monkeypatch.setattr(streams, "STREAM_SPECS", tuple(dataclasses.replace(spec, max_bytes=STREAM_RESERVE_BYTES)
                                                       for spec in streams.STREAM_SPECS))
    monkeypatch.setattr(call_nonces, "call_nonces_max_bytes", STREAM_RESERVE_BYTES)
    monkeypatch.setattr(server_module, "store_bound_bytes", lambda *_: streams_reserve_bytes() + STORE_ROOM_BYTES)
    community = Community.init(tmp_path / "community", "bounded-community")
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=render_authorization(community.roster())) \
            as server:
        yield community, server


async def _events_stored(js, count: int) -> int:
    """How many of `count` events the pipelines stream acknowledged."""
    for done in range(count):
        try:
            await js.publish("hearth.events.pipeline.x.started", EVENT, timeout=2)
        except Exception:
            return done
    return count


async def test_the_event_streams_keep_their_room_and_what_does_not_fit_is_refused_before_it_is_stored(
        small_store, tiny_model_dir):
    """Before, the bucket had no bound: checkpoints took the whole store, the room the event streams reserve
    included, until the broker refused events ("insufficient resources" after 101 of the pipelines stream's 1 MiB of
    events), and the publication that met the full store failed midway with its objects left behind."""
    community, server = small_store
    bound = weights_bucket_bound_bytes(WeightsSettings(), server.store_bound)
    assert bound == int(STORE_ROOM_BYTES * WeightsSettings().store_share)
    await create_community_streams(  # as `hearth nats --community` does at start
        NatsSettings(url=server.url, roster_file=community.roster_path), community.system_key_path,
        ready_timeout_s=5.0, weights_max_bytes=bound)
    nc, js = await _member_js(community, server, "system")
    original = tiny_model_dir("llama", max_shard_size="100KB")
    try:
        published = []
        with pytest.raises(WeightsStoreError) as refused:
            for copy in range(10):
                await publish_checkpoint(js, original, f"copy-{copy}")
                published.append(f"copy-{copy}")
        assert len(published) == 3
        room = await bucket_room(js)
        assert str(refused.value) == (
            f"'copy-3' needs about 1.0 MB in the weights store, which has {room.free / MiB:.1f} MB free of its "
            f"{bound / MiB:.1f} MB: `hearth weights list` shows what it holds, `hearth weights remove NAME` frees a "
            "model's room")
        assert [name for name, _ in await list_models(js)] == published
        assert room.held <= bound
        # The pipelines stream takes events up to its own bound, past which its oldest go: none is refused.
        past_its_bound = STREAM_RESERVE_BYTES // len(EVENT) + 8
        assert await _events_stored(js, past_its_bound) == past_its_bound
    finally:
        await nc.close()


async def test_a_republish_cut_short_by_a_full_store_leaves_nothing_and_the_model_as_it_was(
        js, tiny_model_dir, nats_url, tmp_path, monkeypatch):
    """Before, a publication the store filled under failed with the server's error, and what it had stored stayed
    for a day (until the next publication of the name), taking the room."""
    from hearth.services.broker.connection import connect_nats

    original = tiny_model_dir("llama", max_shard_size="100KB")
    first = await publish_checkpoint(js, original, NAME)
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    filler_connection = await connect_nats(nats_url, name="another-publisher")
    filler_js, publish, chunks = filler_connection.jetstream(), js.publish, []

    async def another_publication_takes_the_room(subject, payload=b"", **kwargs):
        if subject.startswith(f"$O.{WEIGHTS_BUCKET}.C."):
            chunks.append(subject)
            if len(chunks) == 8:  # its side files are stored, its head is not
                room = await bucket_room(filler_js)
                await put_new_object(filler_js, "filler/layer", b"f" * (room.free - 64 * 1024), OBJECT_CHUNK_BYTES)
        return await publish(subject, payload, **kwargs)

    monkeypatch.setattr(js, "publish", another_publication_takes_the_room)
    try:
        with pytest.raises(WeightsStoreError, match=r"^the weights store filled while 'tiny-llama' was published "
                                                    r"\(.* stored: another publication, or the broker's store as a "
                                                    r"whole, took the room meanwhile\): what it stored is removed "
                                                    r"and 'tiny-llama' is as it was$"):
            await publish_checkpoint(js, other, NAME)
    finally:
        monkeypatch.undo()
        await filler_connection.close()

    store = await js.object_store(WEIGHTS_BUCKET)
    assert {info.name for info in await store.list(ignore_deletes=True)} == {
        "filler/layer", object_key(NAME, "manifest.json"),
        *(object_key(NAME, stored.file, first.objects_version) for stored in first.objects)}
    folder = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    from hearth.inference import load_layer_range

    assert _same_parameters(load_layer_range(folder, 0, 1, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 0, 1, **RUNNER_KV_LIMITS))


async def test_a_reader_of_an_object_missing_chunks_is_told_it_is_incomplete(js, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    """Before, an object some of whose chunks were gone (purged, lost by the broker) was refused as not matching the
    SHA-256 in its manifest, "republished or tampered with"."""
    from hearth.services import weights_publish

    monkeypatch.setattr(weights_publish, "OBJECT_CHUNK_BYTES", 16 * 1024)  # a layer in several chunks
    manifest = await publish_checkpoint(js, tiny_model_dir("llama", max_shard_size="100KB"), NAME)
    key = object_key(NAME, LAYER_OBJECT_FORMAT.format(1), manifest.objects_version)
    info = await (await js.object_store(WEIGHTS_BUCKET)).get_info(key)
    await js.purge_stream(WEIGHTS_STREAM, subject=f"$O.{WEIGHTS_BUCKET}.C.{info.nuid}", keep=1)

    with pytest.raises(ObjectIncomplete, match=rf"^object layer-00001.safetensors of 'tiny-llama' is incomplete in the "
                                               rf"store \(1 of its {info.chunks} chunks\): publish it again$"):
        await asyncio.wait_for(fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path), 20)


def _fetched(nats_url: str, cache_dir) -> bool:
    from hearth.services.broker.connection import connect_nats

    async def fetch():
        nc = await connect_nats(nats_url, name="weights-reader")
        try:
            return (await fetch_stored_model(nc.jetstream(), NAME, (0, 1), cache_dir=cache_dir)).is_dir()
        finally:
            await nc.close()

    return asyncio.run(fetch())


def _last_line(said: str) -> str:
    return said.strip().splitlines()[-1]  # after the WARNING of a run without credentials


def test_the_store_lists_its_room_refuses_what_does_not_fit_and_gives_a_removed_models_room_back(
        published, tiny_model_dir, nats_url, tmp_path, monkeypatch):
    from hearth.services.cli import app

    monkeypatch.setenv("HEARTH_NATS__INSECURE", "1")
    runner = CliRunner()

    listed = runner.invoke(app, ["weights", "list", "--nats", nats_url])
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.startswith(f"{NAME}\t6 layers\t1.0 MB\t")
    assert _last_line(listed.stderr) == "weights store: models 1.0 MB, 1.0 MB held of 64.0 MB, 63.0 MB free"

    # [weights] max_store_mb below what the bucket holds: it removes nothing, and refuses what does not fit.
    monkeypatch.setenv("HEARTH_WEIGHTS__MAX_STORE_MB", "0.5")
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    refused = runner.invoke(app, ["weights", "publish", str(other), "--name", "other", "--nats", nats_url])
    assert refused.exit_code == 2, refused.output
    assert _last_line(refused.stderr) == (
        "hearth weights publish: 'other' needs about 1.0 MB in the weights store, which has 0.0 MB free of its 0.5 MB: "
        "`hearth weights list` shows what it holds, `hearth weights remove NAME` frees a model's room")
    assert _fetched(nats_url, tmp_path)

    removed = runner.invoke(app, ["weights", "remove", f"store:{NAME}", "--nats", nats_url])
    assert removed.exit_code == 0, removed.output
    assert removed.stdout.strip() == f"removed {NAME}: 13 objects, 1.0 MB freed"
    listed = runner.invoke(app, ["weights", "list", "--nats", nats_url])
    assert (listed.exit_code, listed.stdout) == (0, "")
    assert _last_line(listed.stderr) == "weights store: models 0.0 MB, 0.0 MB held of 0.5 MB, 0.5 MB free"
    again = runner.invoke(app, ["weights", "remove", NAME, "--nats", nats_url])
    assert again.exit_code == 2
    assert _last_line(again.stderr) == (f"hearth weights remove: no model '{NAME}' in the community's store "
                                        "(`hearth weights list`)")


def test_community_streams_bounds_the_weights_store_of_a_broker_hearth_did_not_start(small_store, monkeypatch):
    """A broker whose store `hearth nats` did not bound (a --node cluster, one started otherwise): `hearth community
    streams` applies [weights] max_store_mb, and says in one line when the store cannot reserve it."""
    from hearth.services.broker.connection import connect_nats
    from hearth.services.cli import app

    community, server = small_store
    command = ["community", "streams", "--dir", str(community.directory), "--nats", server.url]
    monkeypatch.setenv("HEARTH_WEIGHTS__MAX_STORE_MB", "2")
    bounded = CliRunner().invoke(app, command)
    assert bounded.exit_code == 0, bounded.output
    assert _last_line(bounded.stderr) == f"event streams ready on {server.url}; the weights store may hold 2.0 MB"

    monkeypatch.setenv("HEARTH_WEIGHTS__MAX_STORE_MB", str(STORE_ROOM_BYTES // MiB + 1))
    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 1
    assert _last_line(refused.stderr) == (
        "hearth community streams: the broker's store cannot reserve 5.0 MB for the weights bucket beside what its "
        "other streams reserve: lower [weights] max_store_mb, or free space on the broker's disk and restart it")

    async def bound() -> int | None:
        nc = await connect_nats(server.url, name="steward", settings=NatsSettings(
            url=server.url, creds_file=community.system_key_path))
        try:
            return (await bucket_room(nc.jetstream())).bound
        finally:
            await nc.close()

    assert asyncio.run(bound()) == 2 * MiB
