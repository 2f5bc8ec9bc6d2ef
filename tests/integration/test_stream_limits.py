"""Every hearth stream has max_msg_size, max_bytes and max_age on a real nats-server, a stream made by an older
hearth without them is brought to them, one the broker will not change is named in one line, and the server refuses an
event larger than max_msg_size (headers included)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError
from typer.testing import CliRunner

from hearth.events.streams import (
    STREAM_SPECS,
    StreamsIncompatible,
    StreamsMissing,
    ensure_streams,
    event_max_msg_bytes,
)
from hearth.services.broker.connection import connect_nats
from hearth.services.cli import app as cli_app
from hearth.services.cli_options import EXIT_REFUSED

pytestmark = pytest.mark.integration


@pytest.fixture
async def js(nats_url):
    nc = await connect_nats(nats_url, name="stream-limits")
    yield nc.jetstream()
    await nc.close()


async def test_every_stream_is_created_with_size_and_age_limits(js):
    await ensure_streams(js)
    for spec in STREAM_SPECS:
        config = (await js.stream_info(spec.name)).config
        assert config.max_msg_size == event_max_msg_bytes == spec.max_msg_bytes
        assert config.max_bytes == spec.max_bytes > 0
        assert config.max_age == spec.max_age_s > 0


async def test_a_stream_without_limits_is_brought_to_them(js):
    spec = STREAM_SPECS[0]
    unbounded = dataclasses.replace(spec.config(), max_bytes=-1, max_msg_size=-1)
    await js.add_stream(unbounded)
    await ensure_streams(js)
    config = (await js.stream_info(spec.name)).config
    assert (config.max_msg_size, config.max_bytes) == (spec.max_msg_bytes, spec.max_bytes)


async def test_an_event_over_max_msg_size_is_refused_by_the_server(js):
    await ensure_streams(js)
    subject = "hearth.events.pipeline.p-huge.completed"
    with pytest.raises(APIError, match="(?i)message size exceeds maximum"):
        await js.publish(subject, b"x" * (event_max_msg_bytes + 1))
    acknowledged = await js.publish(subject, b"{}")
    assert acknowledged.seq == 1


async def test_an_event_whose_headers_are_over_max_msg_size_is_refused_by_the_server(js):
    """Headers count toward max_msg_size as the body does: a small event with a huge header is not stored."""
    await ensure_streams(js)
    subject = "hearth.events.pipeline.p-huge-header.completed"
    with pytest.raises(APIError, match="(?i)message size exceeds maximum"):
        await js.publish(subject, b"{}", headers={"X-Padding": "x" * event_max_msg_bytes})


@pytest.mark.parametrize("setting", [{"storage": StorageType.MEMORY}, {"deny_delete": True},
                                     {"retention": RetentionPolicy.WORK_QUEUE}])
async def test_a_stream_the_broker_will_not_bring_to_the_spec_is_named_in_one_line_and_kept(js, setting):
    spec = STREAM_SPECS[0]
    await js.add_stream(dataclasses.replace(spec.config(), **setting))
    await js.publish(f"{spec.subjects[0][:-1]}n.k.heartbeat", b"{}")

    with pytest.raises(StreamsIncompatible) as refused:
        await ensure_streams(js)

    assert isinstance(refused.value, StreamsMissing)  # what every long-running command says in one line
    assert spec.name in str(refused.value) and f"nats stream rm {spec.name}" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert (await js.stream_info(spec.name)).state.messages == 1


async def test_another_stream_holding_the_event_subjects_is_named_in_one_line(js):
    await js.add_stream(StreamConfig(name="EVERYTHING", subjects=["hearth.>"]))

    with pytest.raises(StreamsIncompatible, match="another stream on the broker already holds its subjects"):
        await ensure_streams(js)


def test_a_projector_on_a_broker_with_such_a_stream_says_why_in_one_line(nats_url, tmp_path):
    asyncio.run(_add_memory_stream(nats_url))

    result = CliRunner().invoke(cli_app, ["projector", "--insecure", "--db", str(tmp_path / "rm.sqlite"),
                                          "--nats", nats_url])

    assert result.exit_code == EXIT_REFUSED, result.output
    assert "Traceback" not in result.output and "nats stream rm" in result.stderr


async def _add_memory_stream(url: str) -> None:
    nc = await connect_nats(url, name="stream-limits-memory")
    try:
        await nc.jetstream().add_stream(dataclasses.replace(STREAM_SPECS[0].config(), storage=StorageType.MEMORY))
    finally:
        await nc.close()
