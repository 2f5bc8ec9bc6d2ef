"""A request may name a hub GGUF id (`org/name:FILE.gguf`) the orchestrator was not started with: once live shards
advertise it, its head is fetched (by byte ranges, from a local server speaking the hub's protocol) and loaded as a
preload would load it; while nobody serves it, the request is told so in one line naming the id."""

from __future__ import annotations

import pytest

from hearth.services.orchestrator.catalog import ModelCatalog, UnknownModel
from tests.unit.hub_server import fake_hub  # noqa: F401  (fixture)
from tests.unit.test_hub_gguf import FILE, REPO, served  # noqa: F401  (fixture: the fake hub serving one GGUF)

MODEL = f"{REPO}:{FILE}"


async def test_an_advertised_hub_gguf_is_loaded_on_request_as_a_preload_loads_it(served):
    hub, path = served
    on_request = ModelCatalog()
    on_request.use_advertised(lambda model_id: model_id == MODEL)

    loaded = await on_request.get_requested(MODEL)

    assert hub.downloaded(REPO) == set() and 0 < hub.bytes_sent < path.stat().st_size  # the head's bytes only
    assert await on_request.get_requested(MODEL) is loaded  # loaded once
    preloaded = ModelCatalog()
    await preloaded.preload(MODEL)
    reference = await preloaded.get_requested(MODEL)
    assert (loaded.model_id, loaded.weights_sha256) == (MODEL, reference.weights_sha256)
    assert loaded.head.info == reference.head.info


@pytest.mark.parametrize("advertised", [None, set()], ids=["no-read-model", "nobody-serves-it"])
async def test_a_hub_gguf_nobody_serves_is_refused_in_one_line_naming_it(served, advertised):
    hub, _ = served
    catalog = ModelCatalog()
    if advertised is not None:
        catalog.use_advertised(advertised.__contains__)

    with pytest.raises(UnknownModel) as refused:
        await catalog.get_requested(MODEL)

    message = str(refused.value)
    assert MODEL in message and "no live shard advertises it" in message and "\n" not in message
    assert hub.requests == []  # nothing fetched for a name nobody serves


async def test_an_advertised_id_the_hub_lacks_is_refused_in_one_line_naming_it(served):
    missing = f"{REPO}:absent-Q4_0.gguf"
    catalog = ModelCatalog()
    catalog.use_advertised(lambda model_id: True)

    with pytest.raises(UnknownModel) as refused:
        await catalog.get_requested(missing)

    message = str(refused.value)
    assert missing in message and "cannot fetch its head" in message and "\n" not in message
