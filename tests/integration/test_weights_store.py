"""The community's object store, against a real nats-server: a checkpoint published per layer, a shard host
fetching only its layers' objects (checked against the manifest), loading exactly what the original holds."""

from __future__ import annotations

import shutil

import pytest
import torch

from hearth.inference import load_head, load_layer_range, weights_sha256
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.events.streams import consumer_limits, max_consumers_per_stream, weights_consumer_inactive_limit_s
from hearth.services.broker.connection import connect_nats
from hearth.services.broker.permissions import WEIGHTS_STREAM
from hearth.services.broker.weights_bucket import ensure_weights_bucket
from hearth.services.weights_objects import put_new_object
from hearth.services.weights_publish import publish_checkpoint, remove_model
from hearth.services.weights_store import (
    HEAD_OBJECT,
    LAYER_OBJECT_FORMAT,
    MANIFEST_OBJECT,
    OBJECT_CHUNK_BYTES,
    WEIGHTS_BUCKET,
    WeightsStoreError,
    fetch_stored_model,
    list_models,
    object_key,
)
from tests.unit.inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

NAME = "tiny-llama"


# The weights bucket's bound in these tests, as `hearth nats --community` gives it at start: room for a few tiny models.
TEST_BUCKET_BYTES = 64 * 1024 * 1024


@pytest.fixture
async def js(nats_url):
    nc = await connect_nats(nats_url, name="weights-store-test")
    await ensure_weights_bucket(nc.jetstream(), TEST_BUCKET_BYTES)
    yield nc.jetstream()
    await nc.close()


@pytest.fixture
async def published(js, tiny_model_dir):
    original = tiny_model_dir("llama", max_shard_size="100KB")
    manifest = await publish_checkpoint(js, original, NAME)
    return original, manifest


def _fetched_objects(cache_dir, manifest) -> set[str]:
    root = cache_dir / "store" / NAME / manifest.weights_sha256[:16]
    return {file.name for file in (*root.glob("objects/*"), *root.glob("*/files/*")) if not file.name.startswith(".")}


def _same_parameters(first, second) -> bool:
    left, right = dict(first.named_parameters()), dict(second.named_parameters())
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


async def test_a_shard_fetches_only_its_layers_and_loads_what_the_original_holds(js, published, tmp_path):
    original, manifest = published
    folder = await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)

    fetched = _fetched_objects(tmp_path, manifest)
    assert {file for file in fetched if file.endswith(".safetensors")} == {
        LAYER_OBJECT_FORMAT.format(2), LAYER_OBJECT_FORMAT.format(3)}
    assert {"config.json", "tokenizer.json"} <= fetched
    assert _same_parameters(load_layer_range(folder, 2, 3, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 2, 3, **RUNNER_KV_LIMITS))
    assert weights_sha256(folder, cache_dir=tmp_path / "sums") == weights_sha256(original, cache_dir=tmp_path / "s2")


async def test_the_head_fetches_only_the_head_object(js, published, tmp_path):
    original, manifest = published
    folder = await fetch_stored_model(js, NAME, "head", cache_dir=tmp_path)

    assert {f for f in _fetched_objects(tmp_path, manifest) if f.endswith(".safetensors")} == {HEAD_OBJECT}
    tokens = torch.tensor([[1, 4, 9]])
    assert torch.equal(load_head(folder).embed(tokens), load_head(original).embed(tokens))


async def test_a_corrupted_object_is_refused_with_one_line(js, published, tmp_path):
    _, manifest = published
    store = await js.object_store(WEIGHTS_BUCKET)
    await store.put(object_key(NAME, LAYER_OBJECT_FORMAT.format(1), manifest.objects_version),
                    b"not the layer that was published")
    with pytest.raises(WeightsStoreError, match="layer-00001.safetensors of 'tiny-llama' does not match the SHA-256"):
        await fetch_stored_model(js, NAME, (1, 1), cache_dir=tmp_path)


async def test_an_object_larger_than_its_manifest_states_is_refused_and_leaves_nothing(js, published, tmp_path):
    original, manifest = published
    stated = next(stored for stored in manifest.objects if stored.file == LAYER_OBJECT_FORMAT.format(1))
    store = await js.object_store(WEIGHTS_BUCKET)
    await store.put(object_key(NAME, stated.file, manifest.objects_version), b"\0" * (stated.size + 1))
    with pytest.raises(WeightsStoreError, match=f"layer-00001.safetensors of 'tiny-llama' is {stated.size + 1} "
                                                f"bytes, over {stated.size}"):
        await fetch_stored_model(js, NAME, (1, 1), cache_dir=tmp_path)
    objects = tmp_path / "store" / NAME / manifest.weights_sha256[:16] / "objects"
    assert stated.file not in {file.name for file in objects.iterdir()}
    assert not [file for file in objects.iterdir() if file.name.startswith(f".{stated.file}")]


async def test_an_interrupted_republish_leaves_the_stored_model_as_it_was(js, published, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    import hearth.services.weights_publish as weights_publish

    original, first = published
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    every_blob = weights_publish._layer_blobs

    def stops_after_the_head_and_two_layers(folder):
        for count, blob in enumerate(every_blob(folder)):
            if count == 3:
                raise KeyboardInterrupt("the publisher stops")
            yield blob

    monkeypatch.setattr(weights_publish, "_layer_blobs", stops_after_the_head_and_two_layers)
    with pytest.raises(KeyboardInterrupt):
        await publish_checkpoint(js, other, NAME)
    monkeypatch.undo()
    store = await js.object_store(WEIGHTS_BUCKET)
    first_keys = {object_key(NAME, MANIFEST_OBJECT)} | {
        object_key(NAME, stored.file, first.objects_version) for stored in first.objects}
    # What it stored went with it: no object of it is left for a day, taking the bucket's room.
    assert {info.name for info in await store.list(ignore_deletes=True)} == first_keys

    folder = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    assert _same_parameters(load_layer_range(folder, 0, 1, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 0, 1, **RUNNER_KV_LIMITS))
    tokens = torch.tensor([[1, 4, 9]])
    head = await fetch_stored_model(js, NAME, "head", cache_dir=tmp_path)
    assert torch.equal(load_head(head).embed(tokens), load_head(original).embed(tokens))

    # A publisher killed midway (nothing of it ran on) leaves what it stored under a version of its own.
    killed = object_key(NAME, LAYER_OBJECT_FORMAT.format(0), "c" * 16)
    await put_new_object(js, killed, b"stored by a publisher killed since", OBJECT_CHUNK_BYTES)
    second = await publish_checkpoint(js, other, NAME)  # deletes the objects of the manifest it replaced
    stored = {info.name for info in await store.list() if not info.deleted}
    assert not {object_key(NAME, stored.file, first.objects_version) for stored in first.objects} & stored
    assert killed in stored  # kept while it may be a publisher's at work

    monkeypatch.setattr(weights_publish, "ABANDONED_PUBLICATION_AGE_S", 0.0)  # ... until they are old enough
    third = await publish_checkpoint(js, other, NAME)
    assert {info.name for info in await store.list() if not info.deleted} == {
        object_key(NAME, MANIFEST_OBJECT), *(object_key(NAME, stored.file, third.objects_version)
                                             for stored in third.objects)}
    assert len({first.objects_version, second.objects_version, third.objects_version}) == 3


async def test_a_republished_side_file_reaches_hosts_that_fetched_the_previous_one(js, tiny_model_dir, tmp_path):
    original = tmp_path / "original"
    shutil.copytree(tiny_model_dir("llama", max_shard_size="100KB"), original)
    (original / "chat_template.jinja").write_text("the template first published")
    await publish_checkpoint(js, original, NAME)
    head = await fetch_stored_model(js, NAME, "head", cache_dir=tmp_path / "cache")
    assert (head / "chat_template.jinja").read_text() == "the template first published"

    (original / "chat_template.jinja").write_text("the template fixed")  # the same weights, the same weights_sha256
    await publish_checkpoint(js, original, NAME)
    for needed in ("head", (0, 1)):
        folder = await fetch_stored_model(js, NAME, needed, cache_dir=tmp_path / "cache")
        assert (folder / "chat_template.jinja").read_text() == "the template fixed"
    assert (head / "chat_template.jinja").read_text() == "the template first published"  # a folder in use stays


async def test_listing_and_unknown_names(js, published, tmp_path):
    assert [(name, manifest.name) for name, manifest in await list_models(js)] == [(NAME, NAME)]
    with pytest.raises(WeightsStoreError, match="no model 'absent'"):
        await fetch_stored_model(js, "absent", (0, 0), cache_dir=tmp_path)
    with pytest.raises(WeightsStoreError, match="must be 1-64 letters"):
        await fetch_stored_model(js, "../etc", (0, 0), cache_dir=tmp_path)
    with pytest.raises(WeightsStoreError, match="has 6 layers: no layer 9"):
        await fetch_stored_model(js, NAME, (0, 9), cache_dir=tmp_path)


@pytest.fixture
def community_server(tmp_path):
    from hearth.services.broker.permissions import render_authorization
    from hearth.services.broker.server import EmbeddedNatsServer
    from hearth.trust.community import Community

    community = Community.init(tmp_path / "community", "weights-community")
    for name, role in (("shard-a", "shard"), ("orch", "orchestrator"), ("alice", "client")):
        community.add(name, role)
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", authorization=render_authorization(community.roster())) \
            as server:
        yield community, server


async def _member_js(community, server, name: str):
    import nats

    seed = (community.directory / "keys" / f"{name}.nk").read_text()
    nc = await nats.connect(server.url, nkeys_seed_str=seed, inbox_prefix=f"_INBOX.{name}", allow_reconnect=False,
                            connect_timeout=2, error_cb=_ignore)
    return nc, nc.jetstream(timeout=REFUSAL_WAIT_S)


async def _ignore(error: Exception) -> None:
    pass  # refusals are expected here; each shows as the refused call's own error


REFUSAL_WAIT_S = 1.5


async def test_on_a_community_mesh_only_system_writes_and_shard_hosts_and_orchestrators_read(
        community_server, tiny_model_dir, tmp_path):
    community, server = community_server
    original = tiny_model_dir("llama", max_shard_size="100KB")
    system, system_js = await _member_js(community, server, "system")
    shard, shard_js = await _member_js(community, server, "shard-a")
    orchestrator, orchestrator_js = await _member_js(community, server, "orch")
    client, client_js = await _member_js(community, server, "alice")
    try:
        await ensure_weights_bucket(system_js, TEST_BUCKET_BYTES)  # as `hearth nats --community` does at start
        with pytest.raises(Exception):  # the broker refuses: the JetStream API request gets no answer
            await publish_checkpoint(shard_js, original, NAME)
        await publish_checkpoint(system_js, original, NAME)
        # Its readers' consumers are held to the event streams' limits (docs/design.md §11).
        stored = (await system_js.stream_info(WEIGHTS_STREAM)).config
        assert (stored.max_consumers, stored.consumer_limits) == (max_consumers_per_stream,
                                                                  consumer_limits(weights_consumer_inactive_limit_s))

        folder = await fetch_stored_model(shard_js, NAME, (0, 1), cache_dir=tmp_path / "shard")
        assert _same_parameters(load_layer_range(folder, 0, 1, **RUNNER_KV_LIMITS),
                                load_layer_range(original, 0, 1, **RUNNER_KV_LIMITS))
        assert (await fetch_stored_model(orchestrator_js, NAME, "head", cache_dir=tmp_path / "orch")).is_dir()
        with pytest.raises(Exception):
            await fetch_stored_model(client_js, NAME, (0, 1), cache_dir=tmp_path / "client")
        with pytest.raises(Exception):  # a reader cannot overwrite an object
            store = await shard_js.object_store(WEIGHTS_BUCKET)
            await store.put(object_key(NAME, LAYER_OBJECT_FORMAT.format(0)), b"forged")
        with pytest.raises(Exception):  # nor remove a model: only the steward may, as only it publishes
            await remove_model(shard_js, NAME)
        assert [name for name, _ in await list_models(system_js)] == [NAME]
        await remove_model(system_js, NAME)
        assert await list_models(system_js) == []
    finally:
        for nc in (system, shard, orchestrator, client):
            await nc.close()


async def test_a_damaged_cached_object_is_fetched_again_before_its_folder_is_reused(js, published, tmp_path):
    original, manifest = published
    folder = await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)
    damaged = (folder / LAYER_OBJECT_FORMAT.format(2)).resolve()
    stated = next(stored.size for stored in manifest.objects if stored.file == damaged.name)
    with damaged.open("r+b") as handle:  # truncated, as a full disk or a crash leaves a file
        handle.truncate(stated // 2)

    again = await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)
    assert again == folder and damaged.stat().st_size == stated
    assert _same_parameters(load_layer_range(again, 2, 3, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 2, 3, **RUNNER_KV_LIMITS))


async def test_two_publishers_of_one_name_at_once_never_delete_each_others_objects(js, published, tiny_model_dir,
                                                                                   tmp_path, monkeypatch):
    import asyncio
    import threading

    import hearth.services.weights_publish as weights_publish

    original, first = published
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=2)
    every_blob, midway, go_on = weights_publish._layer_blobs, threading.Event(), threading.Event()

    def pauses_midway(folder):
        for count, blob in enumerate(every_blob(folder)):
            if count == 3 and folder == other:  # the slow publisher has stored its side files, the head, 2 layers
                midway.set()
                go_on.wait(timeout=60)
            yield blob

    monkeypatch.setattr(weights_publish, "_layer_blobs", pauses_midway)
    slow = asyncio.create_task(publish_checkpoint(js, other, NAME))
    try:
        assert await asyncio.to_thread(midway.wait, 60)
        fast = await publish_checkpoint(js, original, NAME)  # replaces `first` while `slow` is storing
    finally:
        go_on.set()
    second = await slow  # replaces `fast`

    store = await js.object_store(WEIGHTS_BUCKET)
    assert {info.name for info in await store.list() if not info.deleted} == {
        object_key(NAME, MANIFEST_OBJECT), *(object_key(NAME, stored.file, second.objects_version)
                                             for stored in second.objects)}
    assert len({first.objects_version, fast.objects_version, second.objects_version}) == 3
    folder = await fetch_stored_model(js, NAME, (0, 5), cache_dir=tmp_path)
    assert _same_parameters(load_layer_range(folder, 0, 5, **RUNNER_KV_LIMITS),
                            load_layer_range(other, 0, 5, **RUNNER_KV_LIMITS))


async def test_a_manifest_switch_from_a_state_since_replaced_is_refused_by_the_server(js, published):
    from hearth.services.weights_objects import StoredMeta, put_object_if_unchanged, stored_meta
    from hearth.services.weights_store import read_manifest

    _, manifest = published
    key = object_key(NAME, MANIFEST_OBJECT)
    seen = await stored_meta(js, key)
    assert await put_object_if_unchanged(js, key, manifest.model_dump_json().encode(), seen, 1024)  # chunked
    assert not await put_object_if_unchanged(js, key, b"{}", seen, 1024)  # a switch it did not see came between
    assert not await put_object_if_unchanged(js, key, b"{}", StoredMeta(), 1024)  # only where none is stored
    assert await read_manifest(js, NAME) == manifest
    assert await put_object_if_unchanged(js, object_key("other", MANIFEST_OBJECT), b"{}", StoredMeta(), 1024)


async def test_a_new_publication_fetched_removes_earlier_ones_no_process_uses(js, published, tiny_model_dir,
                                                                              tmp_path):
    import fcntl

    from hearth.inference.cache_versions import IN_USE_LOCK, release_held_versions

    _, first = published
    model_dir = tmp_path / "store" / NAME
    await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    release_held_versions()  # the process that fetched it ended
    second = await publish_checkpoint(js, tiny_model_dir("llama", max_shard_size="100KB", seed=2), NAME)
    with open(model_dir / first.weights_sha256[:16] / IN_USE_LOCK, "a") as other_process:
        fcntl.flock(other_process, fcntl.LOCK_SH)  # ... but another process loaded it and runs on
        await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
        assert (model_dir / first.weights_sha256[:16] / first.digest()[:16] / "layers-0-1").is_dir()
    release_held_versions()

    third = await publish_checkpoint(js, tiny_model_dir("llama", max_shard_size="100KB", seed=3), NAME)
    folder = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
    assert {entry.name for entry in model_dir.iterdir() if not entry.name.startswith(".")} == {
        third.weights_sha256[:16]}
    assert second.weights_sha256 != third.weights_sha256 and folder.is_dir()
    release_held_versions()


async def test_abandoned_objects_are_judged_by_the_servers_clock_not_their_publishers(js, published, monkeypatch):
    """A publisher's clock behind never loses its upload under way to another publisher; one ahead keeps no junk."""
    import asyncio
    from datetime import datetime, timedelta

    import nats.js.object_store as object_store
    import hearth.services.weights_publish as weights_publish

    original, store = published[0], await js.object_store(WEIGHTS_BUCKET)
    under_way = object_key(NAME, LAYER_OBJECT_FORMAT.format(0), "a" * 16)
    junk = object_key(NAME, LAYER_OBJECT_FORMAT.format(0), "b" * 16)

    def stamped(skew: timedelta):
        class SkewedClock(datetime):
            @classmethod
            def now(cls, tz=None):
                return datetime.now(tz) + skew
        return SkewedClock

    monkeypatch.setattr(weights_publish, "ABANDONED_PUBLICATION_AGE_S", 1.0)
    monkeypatch.setattr(object_store, "datetime", stamped(timedelta(days=3650)))
    await store.put(junk, b"left by a publisher whose clock runs ahead")
    await asyncio.sleep(1.5)  # older than the (shortened) abandoned age by the server's clock
    monkeypatch.setattr(object_store, "datetime", stamped(timedelta(days=-2)))
    await store.put(under_way, b"stored just now by a publisher whose clock runs behind")
    monkeypatch.setattr(object_store, "datetime", datetime)

    await publish_checkpoint(js, original, NAME)
    left = {info.name for info in await store.list() if not info.deleted}
    assert under_way in left and junk not in left


async def test_a_range_left_behind_is_removed_with_the_objects_only_it_needed_unless_a_process_holds_it(
        js, published, tmp_path):
    import fcntl

    from hearth.inference.cache_ranges import RANGES_FOLDER, release_held_ranges, release_range

    _, manifest = published
    root = tmp_path / "store" / NAME / manifest.weights_sha256[:16]
    published_dir = root / manifest.digest()[:16]
    layer_objects = lambda: {file.name for file in (root / "objects").glob("layer-*")}  # noqa: E731
    try:
        left = await fetch_stored_model(js, NAME, (0, 1), cache_dir=tmp_path)
        release_range(left)  # a host that moved on to another range
        await fetch_stored_model(js, NAME, (2, 3), cache_dir=tmp_path)
        assert not (published_dir / "layers-0-1").exists()
        assert layer_objects() == {LAYER_OBJECT_FORMAT.format(layer) for layer in (2, 3)}

        release_held_ranges()  # the process serving 2-3 ended ...
        with open(root / RANGES_FOLDER / "layers-2-3.in-use", "a") as other_process:
            fcntl.flock(other_process, fcntl.LOCK_SH)  # ... but another one on the machine serves it
            await fetch_stored_model(js, NAME, (4, 5), cache_dir=tmp_path)
            assert (published_dir / "layers-2-3").is_dir()
            assert layer_objects() == {LAYER_OBJECT_FORMAT.format(layer) for layer in (2, 3, 4, 5)}
    finally:
        release_held_ranges()
