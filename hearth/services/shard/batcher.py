"""StepQueue: continuous batching on a shard: the steps its hops have ready (decode steps, and prefills short enough
to run whole), handed out as batches to the shard's scheduler loop (ShardCompute, hearth/services/shard/compute.py),
which runs each as one batched step on the compute thread (LayerRangeRunner.step_batch) and gives each hop its own row's
result back to pass on to its own next hop, as for a solo step.

The batching policy itself is hearth/services/common/batching.py's ReadyQueue: a batch waits up to `window_s` for more
steps only while fewer steps are queued than hops are open on the shard, so a shard serving one session never waits and
single-session decode is not slowed down. Rows of one batch run the same sub-range of layers and are of one kind;
prefill rows also bring token counts within a factor of two of each other (the same power-of-two bucket), since a
batch pads every row to its longest, and at most `max_tokens` tokens together: a batch of many prompts would hold
every hop's compute for the whole batch in turn, while smaller ones flow through the hops pipelined (hop 1 runs
one while hop 0 runs the next). Other steps wait for a later batch.

With `merge_window_s` (`[shard] batch_merge_window_ms`, for hops that share a machine's cores) a first hop's batch
also waits for the first-hop steps of other sessions that are due within it, so sessions decoding in groups a stage
apart join into one batch (hearth/services/common/batching.py says when and why); later hops receive them together.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from hearth.services.common.batching import ReadyBatch, ReadyQueue
from hearth.protocol.control import OpenHop
from hearth.services.transport import FrameKind, ReceivedStep


@dataclass
class QueuedStep:
    """A hop's step waiting for a batch."""

    request: OpenHop
    received: ReceivedStep
    opener: str | None = None  # who opened the hop (ServedHop.opener): whom its input counts for

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


class StepQueue:
    """A shard's steps ready to run in a batch, and how many batches of each kind its scheduler loop took."""

    def __init__(self, *, window_s: float, max_sessions: int, open_hops: Callable[[], int], max_tokens: int | None,
                 merge_window_s: float) -> None:
        self._ready: ReadyQueue[QueuedStep] = ReadyQueue(
            window_s=window_s, max_rows=max_sessions, open_streams=open_hops, group=lambda queued: queued.group,
            cost=lambda queued: queued.tokens, max_cost=max_tokens, stream=_hop_stream, merges=_first_hop,
            merge_window_s=merge_window_s)
        self._batches: Counter[FrameKind] = Counter()
        self._rows: Counter[FrameKind] = Counter()

    def figures(self, kind: FrameKind) -> tuple[int, int]:
        """Batches of `kind` taken so far and the session rows in them."""
        return self._batches[kind], self._rows[kind]

    def put(self, request: OpenHop, received: ReceivedStep, opener: str | None = None) -> asyncio.Future:
        """Queue one step for the next batch of its group; the future its StepResult (or its row's exception) is set
        on."""
        return self._ready.put(QueuedStep(request, received, opener))

    async def next_batch(self) -> ReadyBatch[QueuedStep] | None:
        """The next batch of steps to run (None when none came for a while: ReadyQueue.next_batch)."""
        batch = await self._ready.next_batch()
        if batch is not None:
            kind = batch.items[0].received.kind
            self._batches[kind] += 1
            self._rows[kind] += len(batch)
        return batch

    def cancel_waiting(self) -> None:
        """Cancel the steps still queued (the shard's scheduler stops)."""
        self._ready.cancel_waiting()


def _hop_stream(queued: QueuedStep) -> Hashable:
    """The pipeline hop a step belongs to: its steps come at that pipeline's pace."""
    return queued.request.pipeline_id, queued.request.hop


def _first_hop(queued: QueuedStep) -> bool:
    """Merging waits for first hops' steps only (hearth/services/common/batching.py says why)."""
    return queued.request.hop == 0
