"""The local fallback's model (hearth/services/orchestrator/local_model.py) is held only together with its weights'
digest: a call cancelled (its client left, its deadline passed) or failing while the model loads or its digest is
computed leaves nothing half-held, and the next fallback loads it whole, instead of finding a model with no digest
that no call's checkpoint ever matches again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from hearth.services.common.config_processes import ShardSettings
from hearth.services.orchestrator import local_model as local_model_module
from hearth.services.orchestrator.local_model import LocalModelHolder


class FakeModel:
    def __init__(self) -> None:
        self.closed = False
        self.info = SimpleNamespace(model_id="tiny")

    def close(self) -> None:
        self.closed = True


def holder(tmp_path: Path) -> LocalModelHolder:
    async def folder(spec, needed):
        return tmp_path

    return LocalModelHolder("tiny", resolve=lambda spec: tmp_path, folder=folder,
                            advertised_id=lambda spec, path: "tiny", hub_id=False, shard_settings=ShardSettings())


@pytest.fixture
def loads(monkeypatch):
    """Each load_full gives a new FakeModel (recorded); digests wait for `digest_may_finish` while it is not set."""
    state = SimpleNamespace(models=[], digest_may_finish=None, digest_fails=False)

    def load_full(path, **kwargs):
        state.models.append(FakeModel())
        return state.models[-1]

    def weights_sha256(path):
        if state.digest_may_finish is not None and not state.digest_may_finish.wait(timeout=10):
            raise TimeoutError("the test never let the digest finish")
        if state.digest_fails:
            raise OSError("a weight file could not be read")
        return "ab" * 32

    monkeypatch.setattr(local_model_module, "load_full", load_full)
    monkeypatch.setattr(local_model_module, "weights_sha256", weights_sha256)
    return state


async def test_a_call_cancelled_while_the_digest_is_computed_leaves_the_next_fallback_a_whole_model(tmp_path, loads):
    import threading

    local = holder(tmp_path)
    loads.digest_may_finish = threading.Event()
    first = asyncio.create_task(local.model({}, wait_for_fetch=False))
    while not loads.models:
        await asyncio.sleep(0.01)
    first.cancel()  # the call's client left while the digest was being computed
    with pytest.raises(asyncio.CancelledError):
        await first
    loads.digest_may_finish.set()
    model = await asyncio.wait_for(local.model({}, wait_for_fetch=False), timeout=10)
    # The cancelled call's load went on and is the next call's: loaded once, held with its digest.
    assert model is loads.models[0] and len(loads.models) == 1 and local.weights_sha256 == "ab" * 32
    local.close()


async def test_a_digest_that_fails_leaves_no_model_without_a_digest(tmp_path, loads):
    local = holder(tmp_path)
    loads.digest_fails = True
    with pytest.raises(OSError):
        await local.model({}, wait_for_fetch=False)
    assert loads.models[0].closed  # not left loaded with nobody to use or close it
    loads.digest_fails = False
    model = await local.model({}, wait_for_fetch=False)
    assert model is loads.models[1] and local.weights_sha256 == "ab" * 32
    local.close()
