"""DecodeBatcher: continuous batching on a shard: gathers the decode steps its hops have ready and runs them as one
batched step on the compute thread (ShardCompute.run_batch, LayerRangeRunner.decode_batch); each hop gets its own
row's result back and passes it on to its own next hop, as for a solo step.

The batching itself is services/common/batching.py's ContinuousBatcher: a batch waits up to `window_s` for more steps
only while fewer steps are queued than hops are open on the shard, so a shard serving one session never waits and
single-session decode is not slowed down. Rows must run the same sub-range of layers; a step of another sub-range
waits for the next batch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.batching import ContinuousBatcher
from services.common.control_protocol import OpenHop
from services.transport import ReceivedStep


@dataclass
class QueuedStep:
    """A hop's decode step waiting for a batch."""

    request: OpenHop
    received: ReceivedStep

    @property
    def layers(self) -> tuple[int, int]:
        return self.request.layer_lo, self.request.layer_hi


class DecodeBatcher:
    """Queues decode steps and runs them in batches through `run_batch` (one result or exception per step)."""

    def __init__(self, run_batch: Callable[[list[QueuedStep]], Awaitable[list]], *, window_s: float,
                 max_sessions: int, open_hops: Callable[[], int]) -> None:
        self._batcher = ContinuousBatcher(run_batch, window_s=window_s, max_rows=max_sessions, open_streams=open_hops,
                                          group=lambda queued: queued.layers, name="shard-decode-batcher")

    @property
    def batches_total(self) -> int:
        return self._batcher.batches_total

    @property
    def rows_total(self) -> int:
        return self._batcher.rows_total

    async def submit(self, request: OpenHop, received: ReceivedStep):
        """Run one decode step in the next batch; its StepResult, or what its row raised."""
        return await self._batcher.submit(QueuedStep(request, received))

    async def close(self) -> None:
        """Stop batching; steps still queued are cancelled."""
        await self._batcher.close()
