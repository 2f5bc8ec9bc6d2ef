"""A running member whose key the broker stops admitting (removed from the community, or its key rotated) is told so
in its log once, not once per reconnect attempt (nats-py tries again every `[nats] reconnect_wait_s`, for ever)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hearth.services.broker.connection import connect_nats
from hearth.services.broker.permissions import render_authorization
from hearth.services.common.config import NatsSettings
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration
RECONNECT_WAIT_S = 0.1
ATTEMPTS_WATCHED_S = 2.0  # about 20 reconnect attempts


@pytest.fixture
def community_broker(tmp_path):
    with community_on_a_broker(tmp_path, (("eve", "auditor"),)) as (community, server):
        yield community, server


async def test_a_member_the_broker_stops_admitting_is_warned_once_not_at_every_attempt(community_broker, caplog):
    community, server = community_broker
    settings = NatsSettings(url=server.url, creds_file=community.directory / "keys" / "eve.nk",
                            reconnect_wait_s=RECONNECT_WAIT_S)
    connection = await connect_nats(server.url, name="test-eve", settings=settings)
    try:
        with caplog.at_level(logging.DEBUG, logger="hearth.services.broker.connection"):
            community.remove("eve")
            server.reload(render_authorization(community.roster()))  # `hearth nats --community` does it at once
            await asyncio.sleep(ATTEMPTS_WATCHED_S)
    finally:
        await connection.close()

    attempts = [record for record in caplog.records if "authorization violation" in record.getMessage().lower()]
    warned = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(attempts) > 3, "the broker did not refuse the member's reconnects: nothing to check"
    assert len([record for record in warned if "refuses" in record.getMessage()]) == 1, [r.getMessage() for r in warned]
    assert not [record for record in warned if "authorization violation" in record.getMessage().lower()], \
        [r.getMessage() for r in warned]
