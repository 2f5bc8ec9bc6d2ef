"""What the mesh-wide nonce record (hearth/services/common/call_nonces.py) adds to each signed call: one create into
the bucket, back to back, on a loopback nats-server configured as `hearth nats` runs it (fsync before every ack).

Prints the median and 99th percentile of a new nonce's record (an admitted call), of a replayed one's refusal, and
of a core NATS request/reply on the same connection for scale:

    .venv/bin/python scripts/bench_call_nonces.py --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import nats

from hearth.events.streams import StreamSetup
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.common.call_nonces import MeshNonces
from hearth.trust.keys import MemberKey


def percentiles_ms(samples: list[float]) -> str:
    quantiles = statistics.quantiles(samples, n=100)
    return f"p50 {statistics.median(samples) * 1000:.3f} ms, p99 {quantiles[98] * 1000:.3f} ms"


async def bench(url: str, calls: int) -> None:
    nc = await nats.connect(url)
    try:
        nonces = MeshNonces(nc.jetstream(), window_s=60, recorded_by="bench")
        await nonces.ready(StreamSetup(create=True))
        signer = MemberKey.generate().public_key

        async def echo(msg) -> None:
            await nc.publish(msg.reply, b"")

        await nc.subscribe("bench.echo", cb=echo)
        seen = [secrets.token_hex(16) for _ in range(calls)]
        new, replayed, echoed = [], [], []
        for nonce in seen:
            started = time.perf_counter()
            assert await nonces.first_on_mesh(signer, nonce)
            new.append(time.perf_counter() - started)
        for nonce in seen:
            started = time.perf_counter()
            assert not await nonces.first_on_mesh(signer, nonce)
            replayed.append(time.perf_counter() - started)
        for _ in range(calls):
            started = time.perf_counter()
            await nc.request("bench.echo", b"", timeout=2)
            echoed.append(time.perf_counter() - started)
        print(f"new nonce recorded ({calls}): {percentiles_ms(new)}")
        print(f"replayed nonce refused ({calls}): {percentiles_ms(replayed)}")
        print(f"core request/reply for scale ({calls}): {percentiles_ms(echoed)}")
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as store, EmbeddedNatsServer(store_dir=Path(store)) as server:
        asyncio.run(bench(server.url, arguments.calls))


if __name__ == "__main__":
    main()
