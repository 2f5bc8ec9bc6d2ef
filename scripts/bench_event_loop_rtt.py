"""NATS request/echo round trip between two processes on the stdlib asyncio loop and on uvloop.

Starts a nats-server, an echo process and a client; the client publishes a 4 KiB message with two headers
and waits for the echo, back to back and after an idle gap (a pipeline hop idles while the others compute):

    .venv/bin/python scripts/bench_event_loop_rtt.py --gaps-ms 0 30 --messages 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from hearth.services.common.lifecycle import EVENT_LOOP_ENV, run_event_loop
from hearth.services.broker.server import EmbeddedNatsServer

ECHO_SUBJECT = "bench.echo"


async def echo(url: str) -> None:
    import nats

    nc = await nats.connect(url)

    async def reply(msg) -> None:
        await nc.publish(msg.reply, msg.data, headers=msg.headers)

    await nc.subscribe(ECHO_SUBJECT, cb=reply)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.sleep(3600)


async def client(url: str, messages: int, gap_ms: float) -> tuple[float, float]:
    import nats

    nc = await nats.connect(url)
    inbox = nc.new_inbox()
    arrived: asyncio.Future | None = None

    async def on_reply(msg) -> None:
        if arrived is not None and not arrived.done():
            arrived.set_result(time.perf_counter())

    await nc.subscribe(inbox, cb=on_reply)
    payload = os.urandom(4096)
    rtts_ms = []
    for index in range(messages):
        arrived = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        await nc.publish(ECHO_SUBJECT, payload, reply=inbox, headers={"Hearth-Step": str(index), "Hearth-Kind": "decode"})
        rtts_ms.append((await asyncio.wait_for(arrived, 5) - started) * 1000)
        if gap_ms:
            await asyncio.sleep(gap_ms / 1000)
    await nc.close()
    rtts_ms.sort()
    return rtts_ms[len(rtts_ms) // 2], rtts_ms[int(len(rtts_ms) * 0.95)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 30.0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--echo", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        run_event_loop(echo(args.echo))
        return
    print("| event loop (both processes) | idle gap | RTT p50 | RTT p95 |")
    print("|---|---:|---:|---:|")
    with EmbeddedNatsServer() as server:
        for loop_name in ("asyncio", "uvloop"):
            env = {**os.environ, EVENT_LOOP_ENV: loop_name}
            os.environ[EVENT_LOOP_ENV] = loop_name
            echo_process = subprocess.Popen([sys.executable, __file__, "--echo", server.url], env=env,
                                            stdout=subprocess.PIPE, text=True)
            try:
                echo_process.stdout.readline()
                for gap_ms in args.gaps_ms:
                    p50, p95 = run_event_loop(client(server.url, args.messages, gap_ms))
                    print(f"| {loop_name} | {gap_ms:g} ms | {p50:.3f} ms | {p95:.3f} ms |", flush=True)
            finally:
                echo_process.kill()
                echo_process.wait()


if __name__ == "__main__":
    main()
