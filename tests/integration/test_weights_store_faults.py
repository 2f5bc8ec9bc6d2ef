"""The community's object store failing partway, against a real nats-server: a fetch cut short (a full disk)
leaves nothing behind, on disk or on the connection."""

from __future__ import annotations

import errno

import pytest

from hearth.services.weights_objects import fetch_object
from hearth.services.weights_store import LAYER_OBJECT_FORMAT, WeightsStoreError, object_key
from tests.integration.test_weights_store import NAME, js, published  # noqa: F401  (fixtures)
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
