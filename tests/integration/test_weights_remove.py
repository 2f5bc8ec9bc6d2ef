"""`hearth weights remove` while the same name is being published, against a real nats-server: the remove takes the
stored model and leaves the publication under way its objects, so the manifest that publication switches to names
only objects that are there and the store then holds the new model whole. A publication no longer under way (stored
nothing for a day: a publisher killed outright) is removed with the model; a name only being published is refused in
one line."""

from __future__ import annotations

import asyncio
import threading

import pytest

import hearth.services.weights_publish as weights_publish
from hearth.inference import load_layer_range
from hearth.services.weights_objects import put_new_object
from hearth.services.weights_publish import publish_checkpoint, remove_model
from hearth.services.weights_store import MANIFEST_OBJECT, OBJECT_CHUNK_BYTES, WEIGHTS_BUCKET, WeightsStoreError, \
    fetch_stored_model, list_models, object_key
from tests.integration.test_weights_store import NAME, _same_parameters, js, published  # noqa: F401  (fixtures)
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

PAUSE_AFTER_BLOBS = 3  # side files and the head stored, then two layers


def pausing_publication(monkeypatch, folder):
    """Events (midway, go_on): the publication of `folder` pauses once it has stored PAUSE_AFTER_BLOBS objects of
    layers and head, until go_on is set."""
    every_blob, midway, go_on = weights_publish._layer_blobs, threading.Event(), threading.Event()

    def pauses_midway(source):
        for count, blob in enumerate(every_blob(source)):
            if count == PAUSE_AFTER_BLOBS and source == folder:
                midway.set()
                go_on.wait(timeout=60)
            yield blob

    monkeypatch.setattr(weights_publish, "_layer_blobs", pauses_midway)
    return midway, go_on


async def stored_keys(js) -> set[str]:  # noqa: F811 (the fixture's name)
    from nats.js.errors import NotFoundError

    store = await js.object_store(WEIGHTS_BUCKET)
    try:
        return {info.name for info in await store.list() if not info.deleted}
    except NotFoundError:  # an empty bucket
        return set()


async def test_a_remove_during_a_republish_leaves_it_its_objects_and_the_store_then_holds_it_whole(
        js, published, tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    original, first = published
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=3)
    midway, go_on = pausing_publication(monkeypatch, other)
    republish = asyncio.create_task(publish_checkpoint(js, other, NAME))
    try:
        assert await asyncio.to_thread(midway.wait, 60)
        removed = await remove_model(js, NAME)
        assert removed.objects == len(first.objects) + 1 and removed.left_under_way >= PAUSE_AFTER_BLOBS
        assert await list_models(js) == []  # the stored model is gone: no manifest
    finally:
        go_on.set()
    second = await republish
    assert await stored_keys(js) == {object_key(NAME, MANIFEST_OBJECT),
                                     *(object_key(NAME, stored.file, second.objects_version)
                                       for stored in second.objects)}
    folder = await fetch_stored_model(js, NAME, (0, 5), cache_dir=tmp_path)
    assert _same_parameters(load_layer_range(folder, 0, 5, **RUNNER_KV_LIMITS),
                            load_layer_range(other, 0, 5, **RUNNER_KV_LIMITS))


async def test_what_a_killed_publisher_left_is_left_for_a_day_then_removed_with_the_model(js, published,
                                                                                        monkeypatch):  # noqa: F811
    original, first = published
    left_behind = object_key(NAME, "layer-00000.safetensors", "0123456789abcdef")  # a publisher killed outright
    await put_new_object(js, left_behind, b"an object no manifest names", OBJECT_CHUNK_BYTES)
    removed = await remove_model(js, NAME)
    assert (removed.objects, removed.left_under_way) == (len(first.objects) + 1, 1)
    assert await stored_keys(js) == {left_behind}
    # A day on (the age shortened here), it is no publication under way: the name's remove takes it.
    await publish_checkpoint(js, original, NAME)
    monkeypatch.setattr(weights_publish, "ABANDONED_PUBLICATION_AGE_S", 0)
    removed = await remove_model(js, NAME)
    assert removed.left_under_way == 0 and await stored_keys(js) == set()


async def test_a_name_only_being_published_is_refused_in_one_line(js, tiny_model_dir, monkeypatch):  # noqa: F811
    other = tiny_model_dir("llama", max_shard_size="100KB", seed=3)
    midway, go_on = pausing_publication(monkeypatch, other)
    publication = asyncio.create_task(publish_checkpoint(js, other, NAME))
    try:
        assert await asyncio.to_thread(midway.wait, 60)
        with pytest.raises(WeightsStoreError, match=f"^'{NAME}' is being published .*remove it once that "
                                                    "publication ends$"):
            await remove_model(js, NAME)
    finally:
        go_on.set()
    await publication
    assert [name for name, _ in await list_models(js)] == [NAME]
