"""A read-model file damaged where the start does not read (a page torn by a power cut, a bad disk block): the
projector finds it when it reads or writes there, ends in one line naming the file and the rebuild, and applies or
rejects nothing meanwhile: the events wait in the log for the rebuilt file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hearth.events.publish import publish_event
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.projector.main import run_projector
from tests.event_streams import jetstream_with_streams
from tests.readmodel_helpers import constructed, with_a_damaged_table

pytestmark = pytest.mark.integration

wait_timeout_s = 20.0
HEARTH = str(Path(sys.executable).parent / "hearth")


async def refusal_of(path: Path, nats_url: str) -> str:
    """The one line `run_projector` on `path` ends with, once a call's event was published."""
    async with jetstream_with_streams(nats_url, "test-damaged") as js:
        await publish_event(js, constructed("p1", ["m:0-3@a"]))
        with pytest.raises(CommandRefused) as refused:
            async with asyncio.timeout(wait_timeout_s):
                await run_projector(path, nats_url, registry=CollectorRegistry())
    return str(refused.value)


@pytest.mark.parametrize("table", ["projection_positions", "pipelines"])
async def test_a_damaged_table_ends_the_projector_in_one_line_and_nothing_is_rejected(table, nats_url, tmp_path):
    path = with_a_damaged_table(tmp_path / "read.sqlite", table)
    refusal = await refusal_of(path, nats_url)
    assert "\n" not in refusal and str(path) in refusal and "hearth-replay rebuild" in refusal, refusal
    # Nothing was recorded as applied or rejected: the event is still the rebuilt file's to apply.
    with contextlib.closing(sqlite3.connect(path)) as connection:
        assert connection.execute("SELECT count(*) FROM rejected_events").fetchone()[0] == 0


def test_an_orchestrator_whose_read_model_is_found_damaged_ends_in_one_line(nats_url, tmp_path):
    # Its routing would go stale on a read model that applies nothing more: it ends as the projector does.
    path = with_a_damaged_table(tmp_path / "routing.sqlite", "pipelines")
    env = {**{key: value for key, value in os.environ.items() if key not in ("HEARTH_NATS_URL", "HEARTH_CONFIG")},
           "HEARTH_NATS__INSECURE": "1"}
    orchestrator = subprocess.Popen([HEARTH, "orchestrator", "--db", str(path), "--nats", nats_url,
                                     "--node-id", "orch-damaged"], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    try:
        assert orchestrator.stdout.readline().strip() == "orchestrator orch-damaged ready"
        asyncio.run(publish_one_call(nats_url))
        _out, err = orchestrator.communicate(timeout=wait_timeout_s)
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait()
    refusal = [line for line in err.splitlines() if line.startswith("hearth orchestrator: ")]
    assert orchestrator.returncode == 1 and "Traceback" not in err, err
    assert len(refusal) == 1 and str(path) in refusal[0] and "hearth-replay rebuild" in refusal[0], err


async def publish_one_call(nats_url: str) -> None:
    async with jetstream_with_streams(nats_url, "test-damaged-orchestrator") as js:
        await publish_event(js, constructed("p1", ["m:0-3@a"]))
