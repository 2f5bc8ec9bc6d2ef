"""Measures what the households test bed's links cost (hearth/services/devtools/netbed.py): the latency relay's own added
round-trip time and throughput against a direct connection, and its RTT's accuracy.

`relay-cost`: an echo server in the hub, a client in a household; a 64-byte ping-pong (median RTT) and a one-way
bulk transfer (MB/s), each direct to the server and through the relay at 0 ms and at a set RTT. Results belong
in BENCHMARKS.md, "Households over real links". Needs root (network namespaces).

`sweep`: decode tokens/s and time to first token of a mesh across households against link RTT and bandwidth, one
session and several, a long prompt's time to first token, each point against its physical limit
(scripts/bench_links_sweep.py); `plot` draws a sweep's JSON (scripts/links_report.py).

Usage: sudo .venv/bin/python scripts/bench_links.py relay-cost [--pings 500] [--bulk-mb 200] [--rtt-ms 10]
       sudo .venv/bin/python scripts/bench_links.py sweep [--model random:llama-250m] [--json links.json]
            [--plot docs/img/links_tokens_per_second.png]
       .venv/bin/python scripts/bench_links.py plot links.json [--plot PATH]
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

from hearth.services.devtools.netbed import NetBed, unavailable_reason  # noqa: E402

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


def _numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _add_sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument("--model", default="random:llama-250m", help="a model folder or random:<shape>")
    sweep.add_argument("--households", type=int, default=3, help="shard hosts, one per household")
    sweep.add_argument("--rtts-ms", type=_numbers, default=[0.0, 2.0, 10.0, 40.0], help="comma-separated")
    sweep.add_argument("--rates-mbit", type=_numbers, default=[1000.0, 100.0, 20.0], help="comma-separated")
    sweep.add_argument("--prompt-tokens", type=int, default=32)
    sweep.add_argument("--new-tokens", type=int, default=48)
    sweep.add_argument("--sessions", type=int, default=8, help="concurrent sessions (1: only the single session)")
    sweep.add_argument("--repeats", type=int, default=3, help="single-session runs per point (the median counts)")
    sweep.add_argument("--no-paired", dest="paired", action="store_false",
                       help="no 0 ms runs taken in turn with each single-session point above 0 ms")
    sweep.add_argument("--long-prompt-tokens", type=int, default=2000, help="0: no long prompt")
    sweep.add_argument("--long-prompt-rates-mbit", type=_numbers, default=[1000.0, 100.0])
    sweep.add_argument("--long-prompt-rtts-ms", type=_numbers, default=[0.0, 10.0])
    sweep.add_argument("--torch-threads", type=int, default=1, help="per hearth process")
    sweep.add_argument("--json", type=Path, help="write the results here")
    sweep.add_argument("--plot", type=Path, help="draw tokens/s against RTT into this PNG")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cost = commands.add_parser("relay-cost", help="the relay's own added RTT and throughput")
    cost.add_argument("--pings", type=int, default=500)
    cost.add_argument("--bulk-mb", type=int, default=200)
    cost.add_argument("--rtt-ms", type=float, default=10.0)
    _add_sweep_arguments(commands.add_parser("sweep", help="tokens/s and TTFT against link RTT and bandwidth"))
    plot = commands.add_parser("plot", help="print a sweep's tables and draw its plot from its JSON")
    plot.add_argument("json", type=Path)
    plot.add_argument("--plot", type=Path)
    options = parser.parse_args()
    if options.command == "plot":
        from links_report import load_sweep, report_sweep

        report_sweep(load_sweep(options.json), options.plot)
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_links: cannot make a test bed here: {reason}", file=sys.stderr)
        return 2
    if options.command == "relay-cost":
        relay_cost(options)
    elif options.command == "sweep":
        from bench_links_sweep import SweepOptions, run_sweep
        from links_report import report_sweep

        fields = SweepOptions.__dataclass_fields__
        sweep_options = SweepOptions(**{name: getattr(options, name) for name in fields})
        report_sweep(run_sweep(sweep_options, options.json), options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
