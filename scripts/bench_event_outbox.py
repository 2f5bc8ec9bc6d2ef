"""What `EventOutbox.record` costs a call, with the outbox file (hearth/events/outbox_file.py) and without.

A call records a handful of events; each `await record(event)` is timed (what the call waits), and the event loop
thread's CPU over the whole run (records, the writer, its removals; what other calls lose) is divided among the
events; in memory and with the file, whose writer (acked at once by a stand-in broker, no network) removes each
event as a live one would:

    .venv/bin/python scripts/bench_event_outbox.py --events 5000 --dir ~/.cache/hearth-bench-outbox
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from hearth.events.models import PipelineCompleted
from hearth.events.outbox import EventOutbox
from hearth.events.outbox_file import OutboxFile

EVENTS_PER_CALL = 5


class _Connected:
    is_reconnecting = False


class _BrokerAckingAtOnce:
    _nc = _Connected()

    async def publish(self, *args, **kwargs):
        return None


def completed(number: int) -> PipelineCompleted:
    return PipelineCompleted(node_id="bench", pipeline_id=f"p-{number}", prompt_tokens=30, completion_tokens=50,
                             duration_ms=1000.0, tokens_per_second=50.0, finish_reason="stop")


async def measure(events: int, folder: Path | None) -> tuple[list[float], float]:
    """Wall seconds of each `record`, and the event loop thread's CPU seconds per event over the whole run."""
    outbox = EventOutbox(_BrokerAckingAtOnce(), max_queued=10_000, retry_wait_s=0.1)
    outbox.start(await asyncio.to_thread(OutboxFile.claim, folder, "bench") if folder else None)
    walls = []
    loop_cpu = time.thread_time()
    for call in range(events // EVENTS_PER_CALL):
        for number in range(EVENTS_PER_CALL):
            event = completed(call * EVENTS_PER_CALL + number)
            wall = time.perf_counter()
            await outbox.record(event)
            walls.append(time.perf_counter() - wall)
        await outbox.flush(timeout_s=60)  # the call's events stored before the next call's: one call at a time
    loop_cpu = time.thread_time() - loop_cpu
    await outbox.stop(timeout_s=1)
    return walls, loop_cpu / events


def describe(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    return (f"{name}: median {statistics.median(ordered) * 1e6:.1f} us, p99 {ordered[int(len(ordered) * 0.99)] * 1e6:.1f}"
            f" us, mean {statistics.fmean(ordered) * 1e6:.1f} us")


async def main(events: int, folder: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="hearth-bench-outbox-", dir=folder) as scratch:
        for name, where in (("memory", None), ("file", Path(scratch))):
            await measure(events // 5, where)  # warm-up
            walls, loop_cpu = await measure(events, where)
            print(f"{name:6s} {describe('record waits', walls)}; event loop CPU {loop_cpu * 1e6:.1f} us per event")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--dir", type=Path, default=None, help="where the outbox file goes (default: the temp dir)")
    arguments = parser.parse_args()
    if arguments.dir:
        arguments.dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(arguments.events, arguments.dir))
