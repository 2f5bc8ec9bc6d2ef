"""The broker's JetStream store is bounded (`max_file_store`: what it holds plus 3/4 of its disk's free space at
start), a bound too small for hearth's streams is said in one line, a store that met a full disk is named once and its
server restarted once the disk has room again, and the weights bucket's bound is its share of what the streams leave."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from nats.js.errors import APIError

from hearth.events.streams import STREAM_SPECS, StreamsIncompatible, ensure_streams
from hearth.services.broker import store_space
from hearth.services.broker.server import EmbeddedNatsServer, render_server_config
from hearth.services.broker.store_space import FullStoreWatch, MiB
from hearth.services.common.call_nonces import call_nonces_max_bytes


@pytest.fixture
def free_space(monkeypatch) -> dict[str, int]:
    """The store disk's free bytes, as the test sets them."""
    disk = {"free": 10 * 1024 * MiB}
    monkeypatch.setattr(store_space, "free_bytes", lambda folder: disk["free"])
    return disk


def test_the_rendered_config_bounds_the_store_to_what_it_holds_plus_three_quarters_of_the_free_space(
        tmp_path, free_space):
    held = tmp_path / "store" / "jetstream" / "streams"
    held.mkdir(parents=True)
    (held / "1.blk").write_bytes(b"x" * MiB)
    server = EmbeddedNatsServer(store_dir=tmp_path / "store", port=4999)
    server._prepare_store()
    try:
        expected = store_space.bytes_held(tmp_path / "store" / "jetstream") + free_space["free"] * 3 // 4
        assert store_space.bytes_held(tmp_path / "store" / "jetstream") >= MiB  # a restart counts what it holds
        assert f"  max_file_store: {expected}\n" in server.config_path.read_text()
    finally:
        server.close()


def test_a_config_without_a_bound_leaves_nats_servers_default():
    config = render_server_config(host="127.0.0.1", port=1, store_dir=Path("/s"), max_payload_bytes=1)
    assert "max_file_store" not in config


def test_the_streams_reserve_what_their_max_bytes_say():
    assert store_space.streams_reserve_bytes() == sum(spec.max_bytes for spec in STREAM_SPECS) + call_nonces_max_bytes
    assert all(spec.max_bytes > 0 and spec.max_age_s > 0 for spec in STREAM_SPECS)  # old events age out


def test_a_bound_below_what_the_streams_reserve_is_said_once_at_start(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hearth.services.broker.store_space"):
        store_space.warn_when_streams_do_not_fit(tmp_path, store_space.streams_reserve_bytes())
        assert not caplog.records
        store_space.warn_when_streams_do_not_fit(tmp_path, 8 * MiB)
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert "below the 1536 MiB hearth's event streams reserve" in caplog.text


class _JetStreamWithoutRoom:
    async def add_stream(self, config):
        raise APIError(code=500, err_code=10047, description="insufficient storage resources available")


async def test_a_stream_the_store_has_no_room_for_is_named_in_one_line():
    with pytest.raises(StreamsIncompatible, match="HEARTH_SHARDS cannot be created: the broker's store has no room "
                                                  "for the 256 MiB it reserves"):
        await ensure_streams(_JetStreamWithoutRoom(), replicas=1)


class _Server:
    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1


def _say(server: _Server, line: str) -> None:
    with open(server.store_dir / "nats-server.log", "a") as log_file:
        log_file.write(line + "\n")


def test_a_store_that_met_a_full_disk_is_named_once_and_restarted_once_there_is_room(tmp_path, free_space, caplog):
    server = _Server(tmp_path)
    _say(server, "[1] 2026/01/01 00:00:00.0 [ERR] an earlier run's line: no space left on device")
    watch = FullStoreWatch(server, room_to_restart=64 * MiB)
    watch.check()
    assert watch.full_since is None  # what the log said before the watch began is not news
    free_space["free"] = 10 * MiB
    with caplog.at_level(logging.INFO, logger="hearth.services.broker.store_space"):
        for _ in range(3):
            _say(server, "[1] 2026/01/01 00:00:01.0 [ERR] JetStream stream '$G > HEARTH_PIPELINES' critical write "
                         "error: write .../1.blk: no space left on device")
            watch.check()
        assert [record.levelname for record in caplog.records] == ["ERROR"]
        assert "met a full disk" in caplog.text
        assert server.restarts == 0  # not while the disk is still short
        free_space["free"] = 100 * MiB
        watch.check()
        watch.check()
    assert server.restarts == 1
    assert [record.levelname for record in caplog.records] == ["ERROR", "WARNING"]
    assert "restarting nats-server" in caplog.records[-1].getMessage()


def test_a_disk_full_to_the_byte_is_noticed_without_the_servers_log(tmp_path, free_space, caplog):
    server = _Server(tmp_path)  # no log at all: on a full disk the server's lines are lost
    watch = FullStoreWatch(server, room_to_restart=64 * MiB)
    free_space["free"] = 4096
    with caplog.at_level(logging.ERROR, logger="hearth.services.broker.store_space"):
        watch.check()
        watch.check()
    assert len(caplog.records) == 1 and "(4 KiB free)" in caplog.text
    free_space["free"] = 64 * MiB
    watch.check()
    assert server.restarts == 1


def test_the_weights_bucket_takes_its_share_of_the_room_beyond_the_streams_or_the_bound_it_is_given():
    from hearth.services.broker.weights_bucket import weights_bucket_bound_bytes
    from hearth.services.common.config import WeightsSettings

    reserve = store_space.streams_reserve_bytes()
    assert weights_bucket_bound_bytes(WeightsSettings(store_share=0.5), reserve + 100 * MiB) == 50 * MiB
    assert weights_bucket_bound_bytes(WeightsSettings(), reserve) is None  # no room beyond the streams: no bucket
    assert weights_bucket_bound_bytes(WeightsSettings(), None) is None  # a store hearth did not bound
    assert weights_bucket_bound_bytes(WeightsSettings(max_store_mb=2.5), None) == 2.5 * MiB
    assert weights_bucket_bound_bytes(WeightsSettings(max_store_mb=2.5), reserve + 100 * MiB) == 2.5 * MiB
