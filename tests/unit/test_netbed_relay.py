"""The households test bed's latency relay (hearth/services/devtools/netbed_relay.py): bytes arrive whole and in order
both ways, a half-close passes through, an RTT set while a connection runs keeps its bytes in order, and a bed's relay
carries a household's connection to the hub (run in the bed's namespaces where they can be made)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from hearth.services.devtools.netbed import NetBed, unavailable_reason
from hearth.services.devtools.netbed_relay import LatencyRelay, Link

io_timeout_s = 10.0
payload_bytes = 3 * 1024 * 1024 + 17


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send back everything, then end the stream when the other side ends its own."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write_eof()
    writer.close()


async def through_relay(payload: bytes, rtt_ms: float, *, new_rtt_ms: float | None = None) -> bytes:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    upstream_port = server.sockets[0].getsockname()[1]
    probe = socket.create_server(("127.0.0.1", 0))
    listen_port = probe.getsockname()[1]
    probe.close()
    relay = LatencyRelay("127.0.0.1", [Link(listen_port, upstream_port, rtt_ms)])
    await relay.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listen_port)
        half = len(payload) // 2
        writer.write(payload[:half])
        if new_rtt_ms is not None:
            relay.set_rtt(listen_port, new_rtt_ms)
        writer.write(payload[half:])
        writer.write_eof()
        echoed = await asyncio.wait_for(reader.read(), timeout=io_timeout_s)
        writer.close()
        return echoed
    finally:
        await relay.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("rtt_ms", [0.0, 4.0])
async def test_every_byte_comes_back_in_order_and_the_end_passes_through(rtt_ms):
    payload = os.urandom(payload_bytes)
    assert await through_relay(payload, rtt_ms) == payload


async def test_an_rtt_lowered_mid_connection_never_reorders_bytes():
    payload = os.urandom(payload_bytes)
    assert await through_relay(payload, 20.0, new_rtt_ms=0.0) == payload


async def test_a_negative_rtt_is_refused():
    relay = LatencyRelay("127.0.0.1", [Link(1, 2)])
    with pytest.raises(ValueError):
        relay.set_rtt(1, -1.0)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no network namespaces here: {unavailable_reason()}")
def test_a_household_reaches_the_hub_through_the_bed_relay():
    with NetBed(households=1) as bed:
        with bed.entered(bed.hub):
            listener = socket.create_server((bed.hub.address, 0))
        with listener:
            relay = bed.start_relay(listener.getsockname()[1], rtt_ms=2.0)
            with bed.entered(bed.households[0]):
                client = socket.create_connection((bed.hub.address, bed.relay_port(0)), timeout=io_timeout_s)
            listener.settimeout(io_timeout_s)
            accepted, _ = listener.accept()
            with client, accepted:
                client.sendall(b"hearth")
                accepted.settimeout(io_timeout_s)
                assert accepted.recv(16) == b"hearth"
            relay.set_rtt(bed.relay_port(0), 0.0)
    assert not relay.running  # closing the bed ended its relay
