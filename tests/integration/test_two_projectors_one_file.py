"""Two projectors pointed at one read-model file (a misconfiguration) still apply every event exactly once."""

from __future__ import annotations

import pytest

from hearth.readmodels.runner import Projector
from tests.integration.test_projector_exactly_once import db_dump, js, publish_all, uninterrupted_dump  # noqa: F401
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration

wait_timeout_s = 60.0


async def test_two_projectors_on_one_file_end_with_the_rows_of_one(js, tmp_path):  # noqa: F811
    path = tmp_path / "shared.db"
    async with Projector(path, js, batch_max_events=7) as first, Projector(path, js, batch_max_events=5) as second:
        last = await publish_all(js, synthetic_events(pipelines=60, heartbeats_per_shard=30, seed=4))
        for projector in (first, second):
            for stream, seq in last.items():
                await projector.wait_for_position(stream, seq, wait_timeout_s)
    assert db_dump(path) == await uninterrupted_dump(js, tmp_path, "alone.db")
