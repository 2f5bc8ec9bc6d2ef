"""Latency for the households test bed: a TCP relay that delays every byte by a set time each way, in order.

netem (the kernel's delay queue) is missing on some kernels, so a household's broker connection is given its
round-trip time by a relay in the hub's namespace instead: the household dials the relay's port on the hub's
address (the name its TLS certificate holds), the relay dials the broker, and each direction is a reader that
stamps every chunk with the instant it may leave (arrival + RTT/2) and a writer that sends chunks in arrival order
once their instant has come. Reading never waits on the delay, so the relay limits throughput only by its queue
(bytes in flight up to relay_queue_chunks chunks per direction); the link's bandwidth is still shaped by `tc`.
Its own cost is measured in BENCHMARKS.md, "Households over real links".

One relay process serves several links (`--link PORT=UPSTREAM_PORT`), each with its own RTT, changeable while
it runs by writing `PORT RTT_MS` lines to its stdin; it prints `ready` once every port listens.
`RelayProcess` runs one behind a namespace's `ip netns exec` (hearth/services/devtools/netbed.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import select
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

read_chunk_bytes = 64 * 1024
# Chunks waiting out their delay per direction before reading pauses (the relay's own backpressure).
relay_queue_chunks = 1024
# The event loop's timers wake late (epoll's timeout is whole milliseconds, rounded up, plus scheduling; more on a
# busy machine): each wait is cut by a correction that every timed chunk moves by this share of how late (or early)
# it left.
lateness_weight = 0.1
relay_ready_timeout_s = 30.0
relay_stop_timeout_s = 5.0
upstream_connect_timeout_s = 10.0
READY_LINE = "ready"
_END = b""


@dataclass
class Link:
    """One listening port of the relay: where it forwards to and the round-trip time it adds."""

    listen_port: int
    upstream_port: int
    rtt_ms: float = 0.0

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2 / 1000


async def _read_into(reader: asyncio.StreamReader, queue: asyncio.Queue, link: Link) -> None:
    loop = asyncio.get_running_loop()
    try:
        while chunk := await reader.read(read_chunk_bytes):
            await queue.put((loop.time() + link.one_way_delay_s, chunk))
    except (ConnectionError, OSError):
        pass
    await queue.put((loop.time() + link.one_way_delay_s, _END))


class TimerLateness:
    """How late the event loop's timers wake, learnt as a correction subtracted from each wait, so chunks leave on
    time on average rather than always late. Early chunks pull it back: one wake-up late by a load spike must not
    leave later chunks sent with no delay at all."""

    def __init__(self) -> None:
        self.correction_s = 0.0

    async def sleep_until(self, instant: float) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() >= instant:
            return  # already behind (a backlog, not the timer): nothing to learn from it
        wake_at = instant - self.correction_s
        if wake_at > loop.time():
            await asyncio.sleep(wake_at - loop.time())
        self.correction_s = max(0.0, self.correction_s + (loop.time() - instant) * lateness_weight)


async def _write_from(queue: asyncio.Queue, writer: asyncio.StreamWriter, lateness: TimerLateness) -> None:
    while True:
        leaves_at, chunk = await queue.get()
        await lateness.sleep_until(leaves_at)
        if chunk == _END:
            if writer.can_write_eof():
                writer.write_eof()
            await writer.drain()
            return
        writer.write(chunk)
        await writer.drain()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link,
                lateness: TimerLateness) -> None:
    """Copy one direction with the link's delay until the sending side ends it."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=relay_queue_chunks)
    reading = asyncio.create_task(_read_into(reader, queue, link))
    try:
        await _write_from(queue, writer, lateness)
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


class LatencyRelay:
    """Listens on `host` at each link's port and relays every connection to the same host's upstream port."""

    def __init__(self, host: str, links: Sequence[Link]) -> None:
        self.host = host
        self.links = {link.listen_port: link for link in links}
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task] = set()
        self._lateness = TimerLateness()

    async def start(self) -> None:
        for link in self.links.values():
            self._servers.append(await asyncio.start_server(
                lambda r, w, link=link: self._accept(r, w, link), self.host, link.listen_port))

    def set_rtt(self, listen_port: int, rtt_ms: float) -> None:
        if rtt_ms < 0:
            raise ValueError(f"an RTT is at least 0 ms, not {rtt_ms}")
        self.links[listen_port].rtt_ms = rtt_ms

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            async with asyncio.timeout(upstream_connect_timeout_s):
                up_reader, up_writer = await asyncio.open_connection(self.host, link.upstream_port)
        except (OSError, TimeoutError):
            writer.close()
            self._connections.discard(task)
            return
        try:
            await asyncio.gather(_pump(reader, up_writer, link, self._lateness),
                                 _pump(up_reader, writer, link, self._lateness))
        finally:
            for side in (writer, up_writer):
                side.close()
            self._connections.discard(task)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()


async def _follow_rtt_commands(relay: LatencyRelay) -> None:
    """`PORT RTT_MS` lines on stdin change a link's RTT; stdin's end stops the relay."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        port, rtt_ms = line.decode().split()
        relay.set_rtt(int(port), float(rtt_ms))
        print(f"rtt {port} {rtt_ms}", flush=True)


async def _serve(host: str, links: list[Link]) -> None:
    relay = LatencyRelay(host, links)
    await relay.start()
    print(READY_LINE, flush=True)
    try:
        await _follow_rtt_commands(relay)
    finally:
        await relay.close()


def _link_argument(text: str) -> Link:
    listen, _, upstream = text.partition("=")
    return Link(int(listen), int(upstream))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="the address to listen on and to dial the upstream at")
    parser.add_argument("--link", type=_link_argument, action="append", required=True,
                        help="PORT=UPSTREAM_PORT: relay connections to PORT to UPSTREAM_PORT (repeatable)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="every link's round-trip time to start with")
    options = parser.parse_args(argv)
    for link in options.link:
        link.rtt_ms = options.rtt_ms
    asyncio.run(_serve(options.host, options.link))
    return 0


class RelayProcess:
    """A relay running behind `command_prefix` (a namespace's `ip netns exec`); `set_rtt` changes a link's RTT
    while connections through it carry on; `stop()` ends it (closing its stdin)."""

    def __init__(self, host: str, links: Sequence[Link], command_prefix: Sequence[str] = ()) -> None:
        self.host = host
        self.links = {link.listen_port: link for link in links}
        link_args = [arg for link in links for arg in ("--link", f"{link.listen_port}={link.upstream_port}")]
        self._process = subprocess.Popen(
            [*command_prefix, sys.executable, "-m", __name__, "--host", host, *link_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._expect(READY_LINE)
        for link in links:
            if link.rtt_ms:
                self.set_rtt(link.listen_port, link.rtt_ms)

    def _expect(self, line: str) -> None:
        """Wait (bounded) for the relay to print `line`."""
        ready, _, _ = select.select([self._process.stdout], [], [], relay_ready_timeout_s)
        got = self._process.stdout.readline() if ready else ""
        if got.strip() != line:
            self.stop()
            raise RuntimeError(f"the latency relay did not say {line!r} (it said {got!r})")

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def set_rtt(self, listen_port: int, rtt_ms: float) -> None:
        """Give link `listen_port` this round-trip time (RTT/2 each way) for every byte read from now on."""
        self._process.stdin.write(f"{listen_port} {rtt_ms}\n")
        self._process.stdin.flush()
        self._expect(f"rtt {listen_port} {rtt_ms}")
        self.links[listen_port].rtt_ms = rtt_ms

    def stop(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
            try:
                self._process.wait(timeout=relay_stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=relay_stop_timeout_s)


if __name__ == "__main__":
    raise SystemExit(main())
