"""The community's object store when something fails, against a real nats-server: a fetch cut short (a full disk, a
killed host) leaves nothing behind, on disk or on the connection; an unreadable manifest hides no other model."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys

import pytest

from hearth.services.broker.permissions import WEIGHTS_BUCKET, WEIGHTS_STREAM
from hearth.services.broker.weights_bucket import ensure_weights_bucket
from hearth.services.weights_objects import fetch_object
from hearth.services.weights_publish import publish_checkpoint
from hearth.services.weights_store import LAYER_OBJECT_FORMAT, MANIFEST_OBJECT, WeightsStoreError, fetch_stored_model, \
    object_key
from tests.integration.test_weights_store import NAME, TEST_BUCKET_BYTES, _member_js
from tests.integration.test_weights_store import community_server, js, published  # noqa: F401  (fixtures)
from tests.unit.inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)


async def test_an_object_fetch_cut_short_leaves_no_subscription_and_counts_its_chunks(js, published, tmp_path):
    """Before, nats-py's ObjectStore.get kept its chunk subscription (and its heartbeat and flow-control tasks) on
    the connection when writing a chunk failed (a full disk) or the fetch was given up: an orchestrator's connection
    gained one per failed fetch, each fed chunks nobody read."""
    _, manifest = published
    stated = next(stored for stored in manifest.objects if stored.file == LAYER_OBJECT_FORMAT.format(1))
    key = object_key(NAME, stated.file, manifest.objects_version)
    objects = tmp_path / "objects"
    objects.mkdir()
    subscriptions = len(js._nc._subs)

    def disk_full(_bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    for _ in range(3):
        with pytest.raises(WeightsStoreError, match="layer-00001.safetensors of 'tiny-llama' cannot be placed in .*: "
                                                    "No space left on device$"):
            await fetch_object(js, key, NAME, stated, objects, progress=disk_full)
    assert len(js._nc._subs) == subscriptions
    assert not list(objects.iterdir())

    counted = []
    await fetch_object(js, key, NAME, stated, objects, progress=counted.append)
    assert sum(counted) == stated.size and (objects / stated.file).stat().st_size == stated.size
    assert len(js._nc._subs) == subscriptions


KILLED_FETCH = """
import asyncio, sys, time
from pathlib import Path
import hearth.inference.partial_checkpoint as partial_checkpoint
import hearth.services.weights_objects as weights_objects
from hearth.services.broker.connection import connect_nats
from hearth.services.weights_store import fetch_stored_model

url, cache, layer, stop_at, ready = sys.argv[1:]

flushed = weights_objects._flushed

def stopped(*_args, **_kwargs):  # where a host dies: all of an object written, or a range's folder staged
    Path(ready).touch()
    time.sleep(3600)

if stop_at == "object":  # its layer's object, after its side files
    weights_objects._flushed = lambda out: stopped() if "layer-" in out.name else flushed(out)
else:
    partial_checkpoint.written_marker = stopped

async def main():
    nc = await connect_nats(url, name="killed-fetch")
    await fetch_stored_model(nc.jetstream(), "tiny-llama", (int(layer), int(layer)), cache_dir=Path(cache))

asyncio.run(main())
"""


def _left_behind(folder) -> set[str]:
    """What a fetch cut short left in `folder`: entries named with a dot first, apart from the cache's locks."""
    return {entry.name for entry in folder.iterdir() if entry.name.startswith(".") and not entry.name.endswith(
        (".lock", ".ranges"))} if folder.is_dir() else set()


async def test_what_a_killed_fetch_was_writing_is_removed_once_no_process_writes_it(js, published, nats_url,
                                                                                   tmp_path, monkeypatch):
    """Before, a host killed while it fetched an object (a layer: gigabytes) or staged a range's folder (for a GGUF,
    a copy of the range) left its partial file or folder in the cache for good: nothing ever removed a name with a
    dot first. A fetch that is still writing keeps its own."""
    from hearth.inference import partial_checkpoint
    from hearth.inference.partial_checkpoint import BEING_WRITTEN_SUFFIX

    _, manifest = published
    cache = tmp_path / "cache"
    root = cache / "store" / NAME / manifest.weights_sha256[:16]
    published_dir = root / manifest.digest()[:16]
    fetches = []
    try:
        for layer, stop_at in ((1, "object"), (2, "folder")):
            ready = tmp_path / f"ready-{stop_at}"
            fetches.append(subprocess.Popen([sys.executable, "-c", KILLED_FETCH, nats_url, str(cache), str(layer),
                                             stop_at, str(ready)], env={**os.environ, "PYTHONPATH": os.getcwd()}))
            for _ in range(1200):
                if ready.exists() or fetches[-1].poll() is not None:
                    break
                await asyncio.sleep(0.1)
            assert ready.exists(), f"the fetch stopping at its {stop_at} never got there"
        monkeypatch.setattr(partial_checkpoint, "ABANDONED_AFTER_S", 0.0)
        await fetch_stored_model(js, NAME, (0, 0), cache_dir=cache)
        assert _left_behind(root / "objects") and _left_behind(published_dir)  # still being written: kept
        killed_long_ago = published_dir / "files" / f".config.json-x{BEING_WRITTEN_SUFFIX}"
        killed_long_ago.write_bytes(b"{")
    finally:
        for fetch in fetches:
            fetch.kill()
            fetch.wait(timeout=30)

    folder = await fetch_stored_model(js, NAME, (3, 3), cache_dir=cache)
    assert not _left_behind(root / "objects")
    assert not _left_behind(published_dir)
    assert not _left_behind(published_dir / "files")
    assert (folder / LAYER_OBJECT_FORMAT.format(3)).is_file()


def test_an_unreadable_manifest_is_listed_as_such_beside_the_others(published, nats_url, monkeypatch):
    """Before, `hearth weights list` failed whole on one manifest it could not read (malformed, or of a format
    published by a newer hearth), showing none of the models it could."""
    from typer.testing import CliRunner

    from hearth.services.broker.connection import connect_nats
    from hearth.services.cli import app
    from hearth.services.weights_store import MANIFEST_OBJECT

    async def store_a_manifest_of_a_later_format():
        nc = await connect_nats(nats_url, name="later-publisher")
        store = await nc.jetstream().object_store(WEIGHTS_BUCKET)
        await store.put(object_key("later", MANIFEST_OBJECT), b'{"format_version": 3, "name": "later"}')
        await nc.close()

    asyncio.run(store_a_manifest_of_a_later_format())
    monkeypatch.setenv("HEARTH_NATS__INSECURE", "1")
    result = CliRunner().invoke(app, ["weights", "list", "--nats", nats_url])
    assert result.exit_code == 0, result.output
    later, tiny = result.stdout.strip().splitlines()
    assert later.startswith("later\tunreadable: the manifest of 'later' is malformed")
    assert tiny.startswith(f"{NAME}\t6 layers\t")


def _stopped_at(js, where: str, monkeypatch) -> None:
    """Stop `js`'s publisher (Ctrl-C: its task cancelled) at the second chunk of an object (`where` "chunk"), or at
    the first object's meta message, its chunks stored ("meta")."""
    publish, chunks = js.publish, []

    async def cut_off(subject, payload=b"", **kwargs):
        if subject.startswith(f"$O.{WEIGHTS_BUCKET}.C."):
            if where == "chunk" and subject in chunks:
                raise asyncio.CancelledError
            chunks.append(subject)
        elif subject.startswith(f"$O.{WEIGHTS_BUCKET}.M.") and where == "meta":
            raise asyncio.CancelledError
        return await publish(subject, payload, **kwargs)

    monkeypatch.setattr(js, "publish", cut_off)


async def _unnamed_chunks(js) -> set[str]:
    """The chunk subjects of the weights stream that no object's meta message names: nothing could delete them."""
    state = (await js.stream_info(WEIGHTS_STREAM, subjects_filter=f"$O.{WEIGHTS_BUCKET}.C.>")).state
    store = await js.object_store(WEIGHTS_BUCKET)
    named = {info.nuid for info in await store.list(ignore_deletes=True)}
    return {subject for subject in (state.subjects or {}) if subject.rsplit(".", 1)[1] not in named}


@pytest.mark.parametrize("where", ["chunk", "meta"])
async def test_a_publish_stopped_midway_leaves_no_chunks_no_object_names(js, published, tiny_model_dir, where,
                                                                         monkeypatch):
    """Before, a publish stopped (Ctrl-C) while an object's chunks were being stored, or before its meta message was,
    left those chunks in the stream for good: no object names them, so no deletion ever reaches them."""
    from hearth.services import weights_publish

    monkeypatch.setattr(weights_publish, "OBJECT_CHUNK_BYTES", 16 * 1024)  # a layer in several chunks
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    assert not await _unnamed_chunks(js)
    _stopped_at(js, where, monkeypatch)
    with pytest.raises(asyncio.CancelledError):
        await publish_checkpoint(js, other, NAME)
    monkeypatch.undo()
    assert not await _unnamed_chunks(js)


def test_a_key_the_broker_refuses_is_told_as_such_in_one_line(community_server, tiny_model_dir):
    """Before, a member whose key may not read or write the store got `TimeoutError: nats: timeout` as the
    command's line (and a shard host started with it, as its refusal): the broker's refusal went only to a log line
    above it."""
    from hearth.services.common.config import HearthSettings, NatsSettings
    from hearth.services.weights_store import resolve_model_source

    from typer.testing import CliRunner

    from hearth.services.cli import app

    community, server = community_server
    keys = community.directory / "keys"
    original = tiny_model_dir("llama", max_shard_size="100KB")

    async def bucket_made_by_the_steward():  # as `hearth nats --community` makes it at start
        nc, system_js = await _member_js(community, server, "system")
        await ensure_weights_bucket(system_js, TEST_BUCKET_BYTES)
        await nc.close()

    asyncio.run(bucket_made_by_the_steward())
    for command, key in ((["weights", "publish", str(original), "--name", NAME], "shard-a"),
                         (["weights", "list"], "alice")):
        result = CliRunner().invoke(app, [*command, "--nats", server.url, "--creds", str(keys / f"{key}.nk")])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines()[-1].startswith(
            f"hearth {' '.join(command[:2])}: the broker refused this key (nats: permissions violation for publish "
            "to "), result.stderr
    settings = HearthSettings(nats=NatsSettings(url=server.url, creds_file=keys / "alice.nk"))
    with pytest.raises(WeightsStoreError, match="^the broker refused this key"):
        asyncio.run(resolve_model_source(f"store:{NAME}", (0, 1), nats_url=server.url, settings=settings))


async def test_a_fetch_under_way_when_its_model_is_republished_fetches_the_new_publication(js, published,
                                                                                          tiny_model_dir, tmp_path,
                                                                                          monkeypatch):
    """Before, a host fetching while the steward republished failed its start with "lacks its object ...: publish
    it again": the switch deletes the replaced publication's objects, and the fetch never read the manifest anew."""
    from hearth.inference import load_layer_range
    from hearth.services import weights_store
    from tests.integration.test_weights_store import _same_parameters
    from tests.runner_limits import RUNNER_KV_LIMITS

    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    fetch, republished = weights_store.fetch_object, []

    async def republished_meanwhile(*args, **kwargs):
        if not republished:
            republished.append(await publish_checkpoint(js, other, NAME))
        return await fetch(*args, **kwargs)

    monkeypatch.setattr(weights_store, "fetch_object", republished_meanwhile)
    folder = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    assert _same_parameters(load_layer_range(folder, 0, 1, **RUNNER_KV_LIMITS),
                            load_layer_range(other, 0, 1, **RUNNER_KV_LIMITS))


@pytest.mark.parametrize("gone", ["chunks before", "chunks while read", "object while read"])
async def test_an_object_whose_chunks_stop_coming_is_given_up_without_waiting_out_its_size(js, published, tmp_path,
                                                                                             gone, monkeypatch):
    """Before, a fetch whose chunks stopped coming (purged, or the object deleted by a republish after its info was
    read) waited the whole object's deadline: half an hour for a 2 GB layer. Now chunks missing before the read are
    said at once (incomplete), and a chunk that does not come within OBJECT_CHUNK_IDLE_S ends the read, as a missing
    object when it was deleted meanwhile (the fetch then reads the manifest anew)."""
    from hearth.services import weights_objects
    from hearth.services.weights_objects import ObjectIncomplete, ObjectMissing

    _, manifest = published
    stated = next(stored for stored in manifest.objects if stored.file == LAYER_OBJECT_FORMAT.format(1))
    key = object_key(NAME, stated.file, manifest.objects_version)
    store = await js.object_store(WEIGHTS_BUCKET)
    chunks = f"$O.{WEIGHTS_BUCKET}.C.{(await store.get_info(key)).nuid}"
    monkeypatch.setattr(weights_objects, "OBJECT_FETCH_BASE_TIMEOUT_S", 600.0)  # the whole object's: not the one
    monkeypatch.setattr(weights_objects, "OBJECT_CHUNK_IDLE_S", 1.0)
    if gone == "chunks before":
        await js.purge_stream(WEIGHTS_STREAM, subject=chunks)
    else:
        subscribe = js.subscribe

        async def gone_meanwhile(*args, **kwargs):
            if gone == "object while read":
                await store.delete(key)
            else:
                await js.purge_stream(WEIGHTS_STREAM, subject=chunks)
            return await subscribe(*args, **kwargs)

        monkeypatch.setattr(js, "subscribe", gone_meanwhile)
    objects = tmp_path / "objects"
    objects.mkdir()
    refusal, said = {"chunks before": (ObjectIncomplete, "is incomplete in the store \\(0 of its 1 chunks\\)"),
                     "chunks while read": (WeightsStoreError, "no chunk .* for 1 s"),
                     "object while read": (ObjectMissing, "lacks its object")}[gone]
    with pytest.raises(refusal, match=said):
        await asyncio.wait_for(fetch_object(js, key, NAME, stated, objects), 20)


async def test_a_fetched_part_is_refused_for_publishing_in_one_line_before_anything_is_stored(js, published,
                                                                                            tmp_path):
    """Before, publishing a folder hearth fetched (a layer range of a stored or hub model) stored all its objects and
    then failed on its cache marker with a four-line pydantic dump; a part published so would have stood for the
    whole checkpoint's digest with most of its layers missing."""
    from hearth.services.weights_publish import check_publishable

    part = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    one_line = (r"^.*layers-0-1 holds only part of a checkpoint \(fetched by hearth from store:tiny-llama\): publish "
                r"the original$")
    with pytest.raises(WeightsStoreError, match=one_line):
        check_publishable(part)
    with pytest.raises(WeightsStoreError, match=one_line):
        await publish_checkpoint(js, part, "part")
    store = await js.object_store(WEIGHTS_BUCKET)
    assert not [info.name for info in await store.list() if info.name.startswith("part/")]


def test_a_side_file_no_object_may_be_named_is_refused_for_publishing_in_one_line(tiny_model_dir, tmp_path):
    """Before, a side file whose name no object may have (an editor's `tokenizer.json~`) was stored, and then its
    StoredObject failed with a pydantic dump, the objects before it left behind."""
    import shutil

    from hearth.services.weights_publish import check_publishable

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", max_shard_size="100KB"), folder)
    (folder / "tokenizer.json~").write_text("{}")
    with pytest.raises(WeightsStoreError, match=r"^.*tokenizer\.json~ cannot be published under its name \(letters, "
                                                r"digits, '_', '\.' or '-'\): rename or remove it$"):
        check_publishable(folder)


async def test_a_manifest_switch_cut_off_while_storing_its_chunks_leaves_none_behind(js, published, monkeypatch):
    from nats.errors import TimeoutError as NatsTimeout

    from hearth.services.weights_objects import put_object_if_unchanged, stored_meta

    async def chunk_subjects() -> dict:
        info = await js.stream_info(WEIGHTS_STREAM, subjects_filter=f"$O.{WEIGHTS_BUCKET}.C.>")
        return info.state.subjects or {}

    before, publish, published_count = await chunk_subjects(), js.publish, []

    async def cut_off(subject, payload=b"", **kwargs):
        published_count.append(subject)
        if len(published_count) == 3:  # the third chunk: the connection broke
            raise NatsTimeout
        return await publish(subject, payload, **kwargs)

    key = object_key(NAME, MANIFEST_OBJECT)
    monkeypatch.setattr(js, "publish", cut_off)
    with pytest.raises(NatsTimeout):
        await put_object_if_unchanged(js, key, b"{}" * 4096, await stored_meta(js, key), 1024)
    monkeypatch.undo()
    assert await chunk_subjects() == before  # no meta message names them: nothing could delete them later


async def test_the_chunks_a_publisher_killed_outright_left_are_removed_by_a_later_publication_a_day_on(
        js, published, monkeypatch):
    """Killed (kill -9) while storing an object, a publisher leaves its chunks with no meta message naming them: before,
    no publication nor `hearth weights remove` ever reached them, and they held the bucket's room for good. Younger
    ones may be another publisher's, still storing the object."""
    from hearth.services import weights_publish

    monkeypatch.setattr(weights_publish, "ABANDONED_PUBLICATION_AGE_S", 1.0)
    killed, at_work = f"$O.{WEIGHTS_BUCKET}.C.killed", f"$O.{WEIGHTS_BUCKET}.C.atwork"
    await js.publish(killed, b"a chunk of an object whose publisher was killed")
    await asyncio.sleep(1.5)  # older than the (shortened) abandoned age by the server's clock
    await js.publish(at_work, b"a chunk of an object another publisher is storing now")
    assert await _unnamed_chunks(js) == {killed, at_work}

    await publish_checkpoint(js, published[0], NAME)
    assert await _unnamed_chunks(js) == {at_work}
