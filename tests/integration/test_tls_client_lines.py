"""What a member's process says about TLS: a broker reached whose TLS handshake fails (no client certificate where it
asks for one, a CA that does not vouch for it) is named as such in the one line a command ends with, not only as a
broker it could not reach; and a connection that worked says nothing when it closes."""

from __future__ import annotations

import logging

import pytest

from hearth.services.broker.connection import BrokerUnreachable, connect_nats
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.tls import write_throwaway_ca
from hearth.services.common.config import NatsSettings

pytestmark = pytest.mark.integration

HANDSHAKE_WAIT_S = 5


@pytest.fixture
def tls_broker(tmp_path):
    tls = write_throwaway_ca(tmp_path / "tls")
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", tls_block=tls.server_block()) as server:
        yield server, tls


@pytest.mark.parametrize("given", ["ca only", "nothing"])
async def test_a_failed_tls_handshake_is_named_in_the_line_that_ends_the_connect(tls_broker, given):
    server, tls = tls_broker
    # Time for a handshake to fail even on a loaded machine (within 1 s, one ran out before it had).
    settings = NatsSettings(url=server.url, connect_timeout_s=HANDSHAKE_WAIT_S,
                            **({"tls_ca_file": tls.ca_file} if given == "ca only" else {}))
    with pytest.raises(BrokerUnreachable) as refused:
        await connect_nats(server.url, name="test-tls", settings=settings)
    line = str(refused.value)
    assert line.startswith(f"cannot reach NATS at {server.url} within {HANDSHAKE_WAIT_S} s"), line
    assert "TLS" in line and "[nats] tls_" in line, line
    assert ("CERTIFICATE_REQUIRED" if given == "ca only" else "CERTIFICATE_VERIFY_FAILED") in line, line


async def test_a_broker_nobody_listens_for_is_named_without_a_tls_cause(tls_broker):
    server, _ = tls_broker
    url = server.url
    server.stop()
    with pytest.raises(BrokerUnreachable) as unreachable:
        await connect_nats(url, name="test-tls", settings=NatsSettings(url=url, connect_timeout_s=1))
    assert str(unreachable.value) == f"cannot reach NATS at {url} within 1 s"


async def test_a_tls_connection_closes_without_a_warning(tls_broker, caplog):
    # nats-py upgrades its plain connection to TLS after the broker's INFO, and asyncio then warns, as the stream
    # closes, that the protocol's eof_received() answer has no effect: a WARNING line after every `hearth chat`.
    server, tls = tls_broker
    settings = NatsSettings(url=server.url, connect_timeout_s=5, tls_ca_file=tls.ca_file,
                            tls_cert_file=tls.client_cert_file, tls_key_file=tls.client_key_file)
    with caplog.at_level(logging.DEBUG):
        connection = await connect_nats(server.url, name="test-tls", settings=settings)
        await connection.flush(5)
        server.stop()  # the broker closes the stream: the end of file the warning came with
        await connection.close()
    assert not [record.getMessage() for record in caplog.records if record.name == "asyncio"
                and record.levelno >= logging.WARNING]
