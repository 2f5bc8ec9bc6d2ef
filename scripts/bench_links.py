"""Measures what the households test bed's links cost (services/devtools/netbed.py): the latency relay's own added
round-trip time and throughput against a direct connection, and its RTT's accuracy.

`relay-cost`: an echo server in the hub, a client in a household; a 64-byte ping-pong (median RTT) and a one-way
bulk transfer (MB/s), each direct to the server and through the relay at 0 ms and at a set RTT. Results belong
in BENCHMARKS.md, "Households over real links". Needs root (network namespaces).

Usage: sudo .venv/bin/python scripts/bench_links.py relay-cost [--pings 500] [--bulk-mb 200] [--rtt-ms 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.devtools.netbed import NetBed, unavailable_reason  # noqa: E402

ECHO_PORT = 15000
PING_BYTES = 64
BULK_BLOCK_BYTES = 256 * 1024
socket_timeout_s = 30.0


def _serve_echo(bed: NetBed, listening: threading.Event, stop: threading.Event) -> None:
    """In the hub: echo ping-pongs back, and answer a bulk transfer with one byte once it has all arrived."""
    with bed.entered(bed.hub), socket.create_server((bed.hub.address, ECHO_PORT)) as server:
        server.settimeout(0.2)
        listening.set()
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_echo, args=(connection,), daemon=True).start()


def _echo(connection: socket.socket) -> None:
    with connection:
        connection.settimeout(socket_timeout_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = connection.recv(1)
        if mode == b"p":
            while data := connection.recv(PING_BYTES):
                connection.sendall(data)
        elif mode == b"b":
            expected = int.from_bytes(connection.recv(8), "big")
            received = 0
            while received < expected and (data := connection.recv(1 << 20)):
                received += len(data)
            connection.sendall(b"k")


def _connect(bed: NetBed, port: int) -> socket.socket:
    connection = socket.create_connection((bed.hub.address, port), timeout=socket_timeout_s)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def ping_rtt_ms(bed: NetBed, port: int, pings: int) -> float:
    """The median round trip of a PING_BYTES message over one connection."""
    samples = []
    with _connect(bed, port) as connection:
        connection.sendall(b"p")
        message = b"x" * PING_BYTES
        for _ in range(pings):
            started = time.perf_counter()
            connection.sendall(message)
            got = 0
            while got < PING_BYTES:
                got += len(connection.recv(PING_BYTES - got))
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def bulk_mb_per_s(bed: NetBed, port: int, megabytes: int) -> float:
    total = megabytes * 1024 * 1024
    block = b"\0" * BULK_BLOCK_BYTES
    with _connect(bed, port) as connection:
        started = time.perf_counter()
        connection.sendall(b"b" + total.to_bytes(8, "big"))
        for _ in range(total // BULK_BLOCK_BYTES):
            connection.sendall(block)
        connection.recv(1)
        return megabytes / (time.perf_counter() - started)


def relay_cost(options: argparse.Namespace) -> None:
    with NetBed(households=1) as bed:
        listening, stop = threading.Event(), threading.Event()
        server = threading.Thread(target=_serve_echo, args=(bed, listening, stop), daemon=True)
        server.start()
        listening.wait(10)
        relay = bed.start_relay(ECHO_PORT)
        port = bed.relay_port(0)
        try:
            with bed.entered(bed.households[0]):
                rows = [("direct", ECHO_PORT, None), ("relay 0 ms", port, 0.0),
                        (f"relay {options.rtt_ms:g} ms", port, options.rtt_ms)]
                print(f"{'path':<16} {'median RTT ms':>14} {'bulk MB/s':>10}")
                for name, target, rtt in rows:
                    if rtt is not None:
                        relay.set_rtt(port, rtt)
                    pings = options.pings if not rtt else max(50, options.pings // 10)
                    print(f"{name:<16} {ping_rtt_ms(bed, target, pings):>14.3f} "
                          f"{bulk_mb_per_s(bed, target, options.bulk_mb):>10.1f}", flush=True)
        finally:
            stop.set()
            server.join(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cost = commands.add_parser("relay-cost", help="the relay's own added RTT and throughput")
    cost.add_argument("--pings", type=int, default=500)
    cost.add_argument("--bulk-mb", type=int, default=200)
    cost.add_argument("--rtt-ms", type=float, default=10.0)
    options = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_links: cannot make a test bed here: {reason}", file=sys.stderr)
        return 2
    if options.command == "relay-cost":
        relay_cost(options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
