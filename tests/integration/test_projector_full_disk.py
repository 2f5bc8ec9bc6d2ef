"""A projector whose file cannot grow (a full disk) says so in one line (not one per try), applies nothing of the batch,
and once there is room ends with the rows of a run that never lacked it."""

from __future__ import annotations

import asyncio
import logging

import pytest
from sqlalchemy import event

from hearth.readmodels.runner import Projector
from tests.integration.test_projector_exactly_once import db_dump, js, publish_all, uninterrupted_dump  # noqa: F401
from tests.readmodel_helpers import synthetic_events

pytestmark = pytest.mark.integration

wait_timeout_s = 30.0


async def test_a_full_disk_is_one_line_and_nothing_is_lost_once_there_is_room(js, tmp_path, caplog):  # noqa: F811
    path = tmp_path / "rm.db"

    def no_room(dbapi_connection, _record) -> None:
        pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

    async with Projector(path, js) as projector:
        await publish_all(js, synthetic_events(pipelines=5, heartbeats_per_shard=3, seed=5))
        await projector.wait_until_caught_up(wait_timeout_s)
        event.listen(projector.engine, "connect", no_room)
        projector.engine.dispose()  # every connection from now on is capped
        with caplog.at_level(logging.WARNING, logger="hearth.readmodels.runner"):
            last = await publish_all(js, synthetic_events(pipelines=300, heartbeats_per_shard=50, seed=6, t0=100.0))
            while projector.apply_failures_total < 2:
                await asyncio.sleep(0.05)
        failures = [record for record in caplog.records
                    if record.name == "hearth.readmodels.runner" and record.levelno >= logging.WARNING]
        errors = [record for record in failures if record.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None, [record.getMessage() for record in failures]
        assert "disk full: database or disk is full" in errors[0].getMessage()
        # A batch small enough for the pages still free may go in meanwhile: said once, not again within 300 s.
        assert all("again; applying from where it stopped" in record.getMessage()
                   for record in failures if record.levelno < logging.ERROR)
        event.remove(projector.engine, "connect", no_room)
        projector.engine.dispose()
        for stream, seq in last.items():
            await projector.wait_for_position(stream, seq, wait_timeout_s)
    assert db_dump(path) == await uninterrupted_dump(js, tmp_path, "roomy.db")
