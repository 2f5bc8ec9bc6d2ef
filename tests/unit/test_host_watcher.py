"""`hearth host` loading and serving a range: when reading the mesh's coverage fails, the host stops and says why
(rather than ending its range in silence and blaming its budget); a restarted host's watch for holes does not count
its crashed run's advert; a device out of memory while loading is a one-line refusal."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

import hearth.services.host.main as host_main
from hearth.services.common.config import HearthSettings
from hearth.services.host.planner import LayerRange

LAYER_BYTES = [100] * 4


class BrokenCoverage:
    quantization = "none"

    async def replicas(self, leave_out=frozenset()) -> list[int]:
        raise RuntimeError("read model unreadable")

    async def turn(self, current, shard_id) -> int:
        return 0


def quick_checks() -> HearthSettings:
    settings = HearthSettings()
    distributed = settings.research.distributed_inference
    host = distributed.host.model_copy(update={"rebalance_check_interval_s": 0.01})
    research = settings.research.model_copy(update={"distributed_inference": distributed.model_copy(
        update={"host": host})})
    return settings.model_copy(update={"research": research})


async def test_a_failing_coverage_read_stops_the_host_with_its_error(monkeypatch):
    """Before, the watcher's error was swallowed: the range was withdrawn, _serve_until_moved returned None and
    run_host refused with 'a memory budget of ... holds no layer', a budget that had just held the range."""
    served = asyncio.Event()

    async def load_shard(**_):
        return SimpleNamespace(identity=SimpleNamespace(shard_id="m:0-1@me"), runner=None)

    async def serve_loaded_shard(loaded, *, stop_event, **_):
        served.set()
        await asyncio.wait_for(stop_event.wait(), timeout=10)

    monkeypatch.setattr(host_main, "load_shard", load_shard)
    monkeypatch.setattr(host_main, "serve_loaded_shard", serve_loaded_shard)
    monkeypatch.setattr(host_main, "until_stopped_or_closed", lambda nc, stop_event, name: stop_event.wait())
    with pytest.raises(RuntimeError, match="read model unreadable"):
        await asyncio.wait_for(host_main._serve_until_moved(
            LayerRange(0, 1), BrokenCoverage(), None, model="m", model_id="m", node="me", settings=quick_checks(),
            device=None, dtype=None, nats_url=None, layer_bytes=LAYER_BYTES, weights_budget=250, busy_threads=None,
            ready_file=None, stop_event=asyncio.Event()), timeout=10)
    assert served.is_set()


async def test_a_restarted_host_does_not_take_its_crashed_runs_advert_for_a_replica_of_its_layers(tmp_path):
    """A host restarted after a crash (here with a larger budget: another range, another shard id) left its earlier
    shard out of its first choice only: watching for holes, it counted that advert (alive until the health timeout)
    as another replica of its layers, and moved to a hole, leaving them held by nobody."""
    from hearth.services.host.main import wait_for_hole
    from tests.unit.test_host_planner import Mesh
    from tests.readmodel_helpers import migrated_engine

    engine = migrated_engine(tmp_path / "host.db")
    try:
        mesh = Mesh(engine)
        mesh.add(0, 1, "a")
        crashed = mesh.add(2, 3, "me")  # the earlier run's, no longer answering
        mesh.add(4, 4, "c")
        mine = mesh.add(2, 4, "me")  # layers 5-7 are a hole; 2-3 are held by this host alone
        settings = quick_checks()
        distributed = settings.research.distributed_inference
        host = distributed.host.model_copy(update={"rebalance_hold_s": 0.05})
        settings = settings.model_copy(update={"research": settings.research.model_copy(update={
            "distributed_inference": distributed.model_copy(update={"host": host})})})
        with pytest.raises(TimeoutError):
            moved_to = await asyncio.wait_for(wait_for_hole(
                mesh.coverage(), LayerRange(2, 4), mine, [100] * 8, 300, settings, leave_out={crashed}), timeout=1)
            pytest.fail(f"moved to {moved_to}, dropping the last replica of layers 2-3")
    finally:
        engine.dispose()


async def test_running_out_of_device_memory_while_loading_is_one_line_refusal(monkeypatch):
    """A device that had less room than its free memory said (another process took some, fragmentation) raised
    torch's OutOfMemoryError through the host as a traceback."""
    import hearth.services.shard.main as shard_main
    from hearth.services.shard.main import ShardRefused, load_shard
    from tests.integration.tiny_shard_server import MODEL

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(shard_main, "load_layer_range", out_of_memory)
    with pytest.raises(ShardRefused, match=r"^cannot load layers 0-1 of .*: CUDA out of memory. Tried to allocate "
                                           r"2.00 GiB$"):
        await load_shard(model=str(MODEL), lo=0, hi=1, node="me", settings=HearthSettings(), model_id=None,
                         device="cpu", dtype=None, stop_event=asyncio.Event())


async def test_a_host_whose_range_another_process_of_its_node_kept_chooses_again_once_per_range(tmp_path):
    """Its rival's advert may not have reached the read model yet: the taken layers count as held all the same.
    When the best choice is a taken range again, there is none (the host stops with the refusal)."""
    from hearth.services.host.main import range_besides_taken
    from tests.unit.test_host_planner import Mesh
    from tests.readmodel_helpers import migrated_engine

    engine = migrated_engine(tmp_path / "host.db")
    try:
        coverage = Mesh(engine).coverage()
        assert await range_besides_taken(coverage, {LayerRange(0, 1)}, set(), [100] * 8, 250) == LayerRange(2, 3)
        assert await range_besides_taken(coverage, {LayerRange(0, 7)}, set(), [100] * 8, 800) is None
    finally:
        engine.dispose()
