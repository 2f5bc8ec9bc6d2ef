"""`hearth host` remembering the range it last served: hosts restarted together (a power cut) take their old,
disjoint ranges back at once, where before they all chose the first range and spread out one move at a time; the
remembered range is a preference the planner's rules still bound, and a record of other weights, another scheme or
a budget it no longer fits is ignored with one line."""

from __future__ import annotations

import logging

import pytest

from hearth.services.host.last_range import LastRange, last_range_file, remember_range, remembered_range
from hearth.services.host.planner import LayerRange, choose_range_remembering
from tests.readmodel_helpers import MODEL_ID, WEIGHTS_SHA, migrated_engine
from tests.unit.test_host_planner import Mesh, host_settings, run_for

LAYER_BYTES = [100] * 6
BUDGET = 250  # two layers of six
HOSTS = "abc"


def record(lo: int, hi: int, **fields) -> LastRange:
    return LastRange(**{"model_id": MODEL_ID, "weights_sha256": WEIGHTS_SHA, "quantization": "none",
                        "total_layers": len(LAYER_BYTES), "weights_budget_bytes": BUDGET, "layer_lo": lo,
                        "layer_hi": hi, **fields})


def read_back(path, layer_bytes=LAYER_BYTES, budget=BUDGET, **key) -> LayerRange | None:
    return remembered_range(path, node="a", **{"model_id": MODEL_ID, "weights_sha256": WEIGHTS_SHA,
                                               "quantization": "none", **key},
                            layer_bytes=layer_bytes, weights_budget=budget)


async def power_cut(tmp_path, kept_folder) -> tuple[dict[str, LayerRange], int]:
    """Three hosts restart together on an empty mesh (none sees the others' adverts before choosing), each with
    its file in `kept_folder` (as run_host reads and writes it), then watch for holes as run_host does until the
    model is covered: their first ranges, and how many moves it took."""
    from hearth.services.host.main import wait_for_hole

    engine = migrated_engine(tmp_path / "mesh.db")
    try:
        six = Mesh(engine, layers=len(LAYER_BYTES))
        empty = await six.coverage().replicas()
        first = {node: choose_range_remembering(empty, LAYER_BYTES, BUDGET,
                                                read_back(kept_folder / f"{node}.json")) for node in HOSTS}
        held = {node: (chosen, six.add(chosen.lo, chosen.hi, node)) for node, chosen in first.items()}
        moves = [0]

        async def host(node: str) -> None:
            while True:
                current, shard_id = held[node]
                target = await wait_for_hole(six.coverage(), current, shard_id, LAYER_BYTES, BUDGET,
                                             host_settings(rebalance_hold_s=0.1, rebalance_check_interval_s=0.01))
                six.withdraw(shard_id, node, reason="moved")
                held[node] = (target, six.add(target.lo, target.hi, node))
                moves[0] += 1

        def covered() -> bool:
            return sorted(str(current) for current, _ in held.values()) == ["0-1", "2-3", "4-5"]

        await run_for(30.0, *(host(node) for node in HOSTS), until=covered)
        assert covered()
        for node, (current, _) in held.items():  # as run_host keeps the range once advertised
            remember_range(kept_folder / f"{node}.json", record(current.lo, current.hi))
        return first, moves[0]
    finally:
        engine.dispose()


async def test_hosts_restarted_together_take_their_old_disjoint_ranges_back_without_moving(tmp_path):
    kept = tmp_path / "kept"
    # The first power cut: no host has served yet, so all choose 0-1 and spread out, two moves at least.
    first, moves = await power_cut(tmp_path / "one", kept)
    assert set(first.values()) == {LayerRange(0, 1)} and moves >= 2
    # The next: each comes back to the range it served, the model covered at once, nobody moving.
    first, moves = await power_cut(tmp_path / "two", kept)
    assert sorted(map(str, first.values())) == ["0-1", "2-3", "4-5"] and moves == 0


def test_the_remembered_range_is_a_preference_within_the_planners_rules():
    # An empty mesh: it ranks level with the lowest range, and wins the tie.
    assert choose_range_remembering([0] * 6, LAYER_BYTES, BUDGET, LayerRange(2, 3)) == LayerRange(2, 3)
    # Held by nobody, it is taken even when a wider range would fit from elsewhere (the model's end: one layer).
    assert choose_range_remembering([0] * 6, LAYER_BYTES, BUDGET, LayerRange(5, 5)) == LayerRange(5, 5)
    # Another host serves it as the only copy while 2-5 are held by nobody: the hole comes first.
    assert choose_range_remembering([1, 1, 0, 0, 0, 0], LAYER_BYTES, BUDGET, LayerRange(0, 1)) == LayerRange(2, 3)
    # Partly held, it still wins when it fills as much of the hole as the best choice does.
    assert choose_range_remembering([1, 0, 0, 1, 1, 1], LAYER_BYTES, BUDGET, LayerRange(1, 2)) == LayerRange(1, 2)
    # Every layer held: it wins only when it is among the least replicated.
    assert choose_range_remembering([1, 1, 2, 2, 1, 1], LAYER_BYTES, BUDGET, LayerRange(2, 3)) == LayerRange(0, 1)
    assert choose_range_remembering([1, 1, 2, 2, 1, 1], LAYER_BYTES, BUDGET, LayerRange(4, 5)) == LayerRange(4, 5)
    # Narrower than what now fits from its start (the budget grew): not a range the planner would choose.
    assert choose_range_remembering([0] * 6, LAYER_BYTES, 350, LayerRange(2, 3)) == LayerRange(0, 2)


def test_the_record_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "kept" / "a.json"
    remember_range(path, record(2, 3))
    remember_range(path, record(4, 5))
    assert read_back(path) == LayerRange(4, 5)
    assert [entry.name for entry in path.parent.iterdir()] == ["a.json"]  # no staging file left beside it
    assert read_back(tmp_path / "none.json") is None


@pytest.mark.parametrize("why, key, budget, text", [
    ("other weights", {"weights_sha256": "f" * 64}, BUDGET, None),
    ("another scheme", {"quantization": "int8"}, BUDGET, None),
    ("a budget it no longer fits", {}, 150, None),
    ("a budget that fits more from its start", {}, 350, None),
    ("not a record", {}, BUDGET, "{not json"),
    ("a reversed range", {}, BUDGET, record(3, 2).model_dump_json()),
    ("too large a file", {}, BUDGET, " " * 5000),
])
def test_a_record_that_does_not_fit_is_ignored_with_one_line(tmp_path, caplog, why, key, budget, text):
    path = tmp_path / "a.json"
    if text is None:
        remember_range(path, record(2, 3))
    else:
        path.write_text(text)
    with caplog.at_level(logging.INFO, logger="hearth.services.host.last_range"):
        assert read_back(path, budget=budget, **key) is None, why
    assert len([line for line in caplog.records if line.name == "hearth.services.host.last_range"]) == 1


def test_each_node_and_model_has_its_own_file_beside_the_shard_outbox(tmp_path):
    settings = host_settings()
    settings = settings.model_copy(update={"shard": settings.shard.model_copy(
        update={"event_outbox_dir": tmp_path / "shard-event-outbox"})})
    files = {last_range_file(settings, node, model) for node in ("a", "b") for model in ("m1", "m/2")}
    assert len(files) == 4 and {path.parent for path in files} == {tmp_path / "host-last-range"}
