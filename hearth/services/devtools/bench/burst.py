"""The burst part of `hearth bench` (`--burst N`): N greedy requests sent at once, more than the mesh can run,
and what admission made of them: how many completed and how many were refused (by code), whether every
completed answer is the solo run's, the queue wait the orchestrator reported (done frame,
`timing.queue_wait_ms`), the time to first token the client saw (queue wait included), and the largest place
in the queue a call was told."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from pydantic import BaseModel

from hearth.services.devtools.bench.pipeline import pipeline_generation

# A burst keeps the machine busy for a while: a call waits this long for a first frame and between frames.
burst_frame_timeout_s = 120.0


class BurstFigures(BaseModel):
    requests: int
    completed: int
    # Final-frame code -> calls that ended with it instead of `done`.
    refused: dict[str, int]
    outputs_match_solo: bool
    queue_wait_ms_p50: float | None
    queue_wait_ms_p95: float | None
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    largest_queue_position: int
    wall_s: float
    aggregate_tokens_per_s: float


def percentile(values: list[float], fraction: float) -> float | None:
    """Linear interpolation between the closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def run_burst(nc, model_ref: str, prompt: str, requests: int, new_tokens: int,
                    solo_token_ids: list[int], *, verify: str | None = None) -> BurstFigures:
    """Send `requests` copies of one greedy request (at verification level `verify`, None: the protocol's default)
    at once and wait for every one to end."""
    started = time.perf_counter()
    runs = await asyncio.gather(*(
        pipeline_generation(nc, model_ref, prompt, new_tokens, refusal_is_error=False, verify=verify,
                            first_frame_timeout=burst_frame_timeout_s, frame_gap_timeout=burst_frame_timeout_s)
        for _ in range(requests)))
    wall_s = time.perf_counter() - started
    done = [run for run in runs if run.error_code is None]
    waits = [run.queue_wait_ms for run in done if run.queue_wait_ms is not None]
    ttfts = [run.ttft_ms for run in done if run.token_times_s]
    return BurstFigures(
        requests=requests, completed=len(done),
        refused=dict(Counter(run.error_code for run in runs if run.error_code is not None)),
        outputs_match_solo=all(run.token_ids == solo_token_ids for run in done),
        queue_wait_ms_p50=percentile(waits, 0.5), queue_wait_ms_p95=percentile(waits, 0.95),
        ttft_ms_p50=percentile(ttfts, 0.5), ttft_ms_p95=percentile(ttfts, 0.95),
        largest_queue_position=max((max(run.queue_positions) for run in runs if run.queue_positions), default=0),
        wall_s=wall_s, aggregate_tokens_per_s=sum(run.tokens for run in done) / wall_s,
    )


def burst_lines(figures: BurstFigures) -> list[str]:
    """The burst's part of the text report."""
    refused = ", ".join(f"{count} {code}" for code, count in figures.refused.items()) or "none"
    return [
        f"burst of {figures.requests} requests sent at once: {figures.completed} completed, refused: {refused}; "
        f"answers {'all equal the solo run' if figures.outputs_match_solo else 'DIFFER from the solo run'}",
        f"  queue wait p50 {_ms(figures.queue_wait_ms_p50)} ms, p95 {_ms(figures.queue_wait_ms_p95)} ms; "
        f"time to first token p50 {_ms(figures.ttft_ms_p50)} ms, p95 {_ms(figures.ttft_ms_p95)} ms; "
        f"largest queue position {figures.largest_queue_position}",
        f"  {figures.wall_s:.2f} s for all, {figures.aggregate_tokens_per_s:.2f} tokens/s in aggregate",
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
