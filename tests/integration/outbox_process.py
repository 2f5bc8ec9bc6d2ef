"""A process holding a file-backed event outbox, for tests that kill it (test_event_outbox_kill.py).

`python -m tests.integration.outbox_process NATS_URL FOLDER`: connects, claims an outbox file in FOLDER as owner
`orch`, prints `ready`, then for each line on stdin: `record N FIRST` records PipelineCompleted events for pipelines
p-FIRST .. p-(FIRST+N-1) and prints `recorded DEPTH` (`open N FIRST`: PipelineConstructed events, calls begun);
`flush` waits until all are stored and prints `flushed DEPTH`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from hearth.events.models import PipelineCompleted, PipelineConstructed
from hearth.events.outbox import EventOutbox
from hearth.events.streams import ensure_streams
from hearth.services.broker.connection import connect_nats

OWNER = "orch"
flush_timeout_s = 60.0


def completed(number: int) -> PipelineCompleted:
    return PipelineCompleted(node_id=OWNER, pipeline_id=f"p-{number}", prompt_tokens=3, completion_tokens=5,
                             duration_ms=10.0, tokens_per_second=500.0, finish_reason="stop")


def constructed(number: int) -> PipelineConstructed:
    return PipelineConstructed(node_id=OWNER, pipeline_id=f"p-{number}", request_id=f"r-{number}", model_id="m",
                               weights_sha256="ab" * 32, hops=["m:0-3@a"], construct_ms=1.0)


async def main(nats_url: str, folder: Path) -> None:
    nc = await connect_nats(nats_url, name="test-outbox-process")
    js = nc.jetstream()
    await ensure_streams(js)
    outbox = EventOutbox(js, max_queued=100, retry_wait_s=0.1)
    await outbox.start_in(folder, owner=OWNER)
    print("ready", flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        command, *numbers = line.split()
        if command in ("record", "open"):
            count, first = map(int, numbers)
            for number in range(first, first + count):
                await outbox.record(completed(number) if command == "record" else constructed(number))
            print("recorded", outbox.depth, flush=True)
        elif command == "flush":
            await outbox.flush(flush_timeout_s)
            print("flushed", outbox.depth, flush=True)
    await outbox.stop(timeout_s=1.0)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
