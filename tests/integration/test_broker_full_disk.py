"""A broker whose JetStream store is on a small disk (an 8 MiB tmpfs; root only): its own events age out within the
bound and never fill the disk; a disk another program fills stops its stream (nats-server keeps the write error
until it restarts), which the broker's watch names once and clears by restarting the server once there is room."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess

import nats
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from hearth.services.broker import store_space
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.store_space import FullStoreWatch, MiB

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: root only"),
]

_EVENT = b"e" * 1000


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


async def _publish(js, count: int) -> int:
    """How many of `count` events the stream acknowledged (each refusal waits 0.5 s, so a stop ends the run)."""
    for done in range(count):
        try:
            await js.publish("events.x", _EVENT, timeout=0.5)
        except (nats.errors.Error, TimeoutError):
            return done
    return count


async def test_a_full_disk_is_named_once_and_the_broker_recovers_by_itself(small_disk, caplog):
    server = EmbeddedNatsServer(store_dir=small_disk / "store").start()
    try:
        assert server.store_bound < store_space.free_bytes(small_disk)  # the store cannot fill its disk by itself
        nc = await nats.connect(server.url, reconnect_time_wait=0.1)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name="EVENTS", subjects=["events.>"], storage=StorageType.FILE,
                                             max_bytes=2 * MiB, discard=DiscardPolicy.OLD))
            # Three times its max_bytes: the oldest events go, every one is taken.
            assert await _publish(js, 6000) == 6000
            assert (await js.stream_info("EVENTS")).state.bytes <= 2 * MiB

            watch = FullStoreWatch(server, room_to_restart=2 * MiB)
            filler = small_disk / "another-program"
            # Another program takes the disk: the stream's next block has no room.
            subprocess.run(["fallocate", "-l", str(store_space.free_bytes(small_disk) - 16 * 1024), str(filler)],
                           check=True)
            with caplog.at_level(logging.INFO, logger="hearth.services.broker.store_space"):
                assert await _publish(js, 4000) < 4000
                for _ in range(3):
                    watch.check()
                errors = [record for record in caplog.records if record.levelname == "ERROR"]
                assert len(errors) == 1 and "met a full disk" in errors[0].getMessage()
                filler.unlink()
                assert await _publish(js, 1) == 0  # room again, but the server keeps its write error
                watch.check()  # ... until the watch restarts it
            assert "restarting nats-server" in caplog.text
            async with asyncio.timeout(10):  # the client reconnects by itself, the stream takes events again
                while not await _publish(js, 1):
                    await asyncio.sleep(0.05)
            assert await _publish(js, 100) == 100
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
    finally:
        server.close()
