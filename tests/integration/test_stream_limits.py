"""Every hearth stream has max_msg_size, max_bytes and max_age on a real nats-server, a stream made by an older
hearth without them is brought to them, and the server refuses an event larger than max_msg_size (headers included)."""

from __future__ import annotations

import dataclasses

import pytest
from nats.js.errors import APIError

from hearth.events.streams import STREAM_SPECS, ensure_streams, event_max_msg_bytes
from hearth.services.broker.connection import connect_nats

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
