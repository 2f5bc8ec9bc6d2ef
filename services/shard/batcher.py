"""StepBatcher: continuous batching on a shard: gathers the steps its hops have ready (decode steps, and prefills
short enough to run whole) and runs those that fit together as one batched step on the compute thread
(ShardCompute.run_batch, LayerRangeRunner.step_batch); each hop gets its own row's result back and passes it on to
its own next hop, as for a solo step.

The batching itself is services/common/batching.py's ContinuousBatcher: a batch waits up to `window_s` for more steps
only while fewer steps are queued than hops are open on the shard, so a shard serving one session never waits and
single-session decode is not slowed down. Rows of one batch run the same sub-range of layers and are of one kind;
prefill rows also bring token counts within a factor of two of each other (the same power-of-two bucket), since a
batch pads every row to its longest, and at most `max_tokens` tokens together: a batch of many prompts would hold
every hop's compute for the whole batch in turn, while smaller ones flow through the hops pipelined (hop 1 runs
one while hop 0 runs the next). Other steps wait for a later batch.

With `merge_window_s` (`[shard] batch_merge_window_ms`, for hops that share a machine's cores) a first hop's batch
also waits for the first-hop steps of other sessions that are due within it, so sessions decoding in groups a stage
apart join into one batch (services/common/batching.py says when and why); later hops receive them together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from services.common.batching import ContinuousBatcher
from services.common.control_protocol import OpenHop
from services.transport import FrameKind, ReceivedStep


@dataclass
class QueuedStep:
    """A hop's step waiting for a batch."""

    request: OpenHop
    received: ReceivedStep

    @property
    def layers(self) -> tuple[int, int]:
        return self.request.layer_lo, self.request.layer_hi

    @property
    def tokens(self) -> int:
        return int(self.received.tensor.shape[1])

    @property
    def group(self) -> Hashable:
        """Steps that may share a batch: same layers, same kind, and (prefills) token counts in one power-of-two
        bucket, so padding at most doubles a batch's tokens."""
        return self.layers, self.received.kind, self.tokens.bit_length()


class StepBatcher:
    """Queues steps and runs them in batches through `run_batch` (one result or exception per step)."""

    def __init__(self, run_batch: Callable[[list[QueuedStep]], Awaitable[list]], *, window_s: float,
                 max_sessions: int, open_hops: Callable[[], int], max_tokens: int | None = None,
                 merge_window_s: float = 0.0) -> None:
        self._run_batch = run_batch
        self._batcher = ContinuousBatcher(self._count_and_run, window_s=window_s, max_rows=max_sessions,
                                          open_streams=open_hops, group=lambda queued: queued.group,
                                          cost=lambda queued: queued.tokens, max_cost=max_tokens,
                                          name="shard-step-batcher", stream=_hop_stream, merges=_first_hop,
                                          merge_window_s=merge_window_s)
        self._batches: Counter[FrameKind] = Counter()
        self._rows: Counter[FrameKind] = Counter()

    def figures(self, kind: FrameKind) -> tuple[int, int]:
        """Batches of `kind` run so far and the session rows in them."""
        return self._batches[kind], self._rows[kind]

    async def submit(self, request: OpenHop, received: ReceivedStep):
        """Run one step in the next batch of its group; its StepResult, or what its row raised."""
        return await self._batcher.submit(QueuedStep(request, received))

    async def close(self) -> None:
        """Stop batching; steps still queued are cancelled."""
        await self._batcher.close()

    async def _count_and_run(self, batch: list[QueuedStep]) -> list:
        kind = batch[0].received.kind
        self._batches[kind] += 1
        self._rows[kind] += len(batch)
        return await self._run_batch(batch)


def _hop_stream(queued: QueuedStep) -> Hashable:
    """The pipeline hop a step belongs to: its steps come at that pipeline's pace."""
    return queued.request.pipeline_id, queued.request.hop


def _first_hop(queued: QueuedStep) -> bool:
    """Merging waits for first hops' steps only (ContinuousBatcher says why)."""
    return queued.request.hop == 0
