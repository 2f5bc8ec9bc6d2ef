"""Answer warm-ups: a call that ended well has its hops keep its prompt's blocks at its close and then, in the
background, prefill its answer's whole blocks again and keep those too, so a conversation's next turn prefills only
its new tokens and still samples what a whole prefill of it would.

Why not keep the decoded positions as they are: a decode step computes a position's KV with other kernels than a
prefill (one query: a matrix-vector product, attention of another shape), so their KV is not bitwise a prefill's, and
a next turn that began from it could sample other greedy tokens than the same turn prefilled whole (docs/design.md,
"Kept prefixes"). A prefill split at a block boundary gives the whole prefill's KV: the warm-up opens a fresh chain
over the call's hops that begins from the prompt's kept blocks, prefills the positions up to the last whole block the
call ran, drops the output and closes keeping every block (the same path as a call's: ChainBuilder.over, open,
prefill, close(keep)).

A call whose blocks a warm-up of this orchestrator is bringing in waits for it before routing (AnswerWarmUps.settle,
from the moment the first call's answer is complete, its last frame not sent yet): a conversation's next turn sent at
once would otherwise prefill the answer itself, beside the warm-up doing the same.

Bounded and owned: each warm-up is a task of AnswerWarmUps (cancelled on shutdown), at most `max_warm_ups` at once,
within `[prefix_cache] warm_up_timeout_s`, started beside the call once it ended (its last frame sent, or for a
choice of `n` held for the group's: choices.py) and its chain closed; skipped (never retried) when a hop refused us
for room a moment ago, and a failed or late one leaves only the prompt's blocks kept (`hearth_answer_warm_ups_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hearth.inference.compute_thread import on_compute_thread
from hearth.services.common.lifecycle import event_within, log_failure
from hearth.services.orchestrator.affinity import hop_ranges
from hearth.services.orchestrator.call import new_pipeline_id
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.kept_inputs import keep_chain_inputs
from hearth.services.orchestrator.metrics import answer_warm_ups_total
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.prefill import prefill
from hearth.services.orchestrator.router import Hop

log = logging.getLogger(__name__)

# `ctx` below is the orchestrator's RunContext and `builder` the call's ChainBuilder (not imported: each imports this).

# Warm-ups of one orchestrator under way at once; a call that ends beyond them keeps only its prompt's blocks.
max_warm_ups = 4
KEPT, FAILED, SKIPPED = "kept", "failed", "skipped"
# The longest a call waits for warm-ups bringing in its blocks: about what prefilling an answer itself would cost it,
# and a warm-up stuck on a frozen hop holds the next turn no longer than that.
max_settle_wait_s = 5.0


@dataclass
class _Expected:
    """A warm-up announced (its call's answer complete) and not over: the names of the blocks it brings in, and
    until when a call may wait for it."""

    names: frozenset[str]
    deadline: float
    over: asyncio.Event = field(default_factory=asyncio.Event)


class AnswerWarmUps:
    """The answer warm-ups announced or under way (tasks of the orchestrator's, cancelled by `close`)."""

    def __init__(self, limit: int = max_warm_ups) -> None:
        self.limit = limit
        self._tasks: set[asyncio.Task] = set()
        self._expected: dict[int, _Expected] = {}  # by the id of the call's ChainBuilder

    def expect(self, builder, timeout_s: float) -> None:
        """Announce the warm-up of `builder`'s call (its `warm_up` blocks past its `kept` ones), at most `timeout_s`
        from now, before the call's last frame lets its caller send the next turn."""
        kept = len(builder.kept.hashes) if builder.kept is not None else 0
        self._expected[id(builder)] = _Expected(frozenset(builder.warm_up.hashes[kept:]), time.monotonic() + timeout_s)

    def forget(self, builder) -> None:
        """The warm-up announced for `builder`'s call is over (or will not run): nobody waits for it any more."""
        self._over(id(builder))

    def _over(self, key: int) -> None:
        expected = self._expected.pop(key, None)
        if expected is not None:
            expected.over.set()

    async def settle(self, names: Iterable[str]) -> None:
        """Until every warm-up announced that brings in one of the blocks `names` is over (each at most until its
        deadline, all at most `max_settle_wait_s`)."""
        now = time.monotonic()
        for key, expected in list(self._expected.items()):
            if expected.deadline <= now:
                self._over(key)
        wanted = set(names)
        pending = [expected for expected in self._expected.values() if expected.names & wanted]
        until = time.monotonic() + max_settle_wait_s
        for expected in pending:
            left = min(expected.deadline, until) - time.monotonic()
            if left > 0 and not expected.over.is_set():
                # Not over in time: routed as things are (at worst the answer is prefilled again by this call).
                await event_within(expected.over, left)

    def start(self, ctx, builder, hops: list[Hop]) -> None:
        """Warm the answer of `builder`'s call (which ended well, its chain over `hops` closed) up in the
        background."""
        if len(self._tasks) >= self.limit:
            answer_warm_ups_total.labels(SKIPPED).inc()
            self.forget(builder)
            return
        task = asyncio.create_task(self._run(ctx, builder, hops), name=f"warm-up-{builder.call.pipeline_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self.forget(builder))

    async def close(self) -> None:
        for key in list(self._expected):
            self._over(key)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, ctx, builder, hops: list[Hop]) -> None:
        timeout_s = ctx.settings.prefix_cache.warm_up_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await warm_up(ctx, builder, hops)
        except TimeoutError:
            log.info("pipeline %s: its answer's warm-up took over %s s; only its prompt's blocks stay kept",
                     builder.call.pipeline_id, timeout_s)
            outcome = FAILED
        except Exception as error:  # a warm-up is an optimisation: whatever failed it, the prompt's blocks stay
            # By its type and place: its message may quote the answer's tokens or activations.
            log_failure(log, f"pipeline {builder.call.pipeline_id}: its answer's warm-up", error, logging.WARNING)
            outcome = FAILED
        answer_warm_ups_total.labels(outcome).inc()


async def close_keeping(ctx, builder, chain: HopChain, ended_well: bool) -> None:
    """Close the call's `chain`; when the call ended well its hops keep the prompt's blocks (with what entered them,
    for checks) and the answer's warm-up starts."""
    kept = builder.kept if ended_well else None
    started = False
    try:
        try:
            if kept is not None:
                await keep_chain_inputs(ctx.kept_inputs, chain, kept)
        finally:  # the hops are told to close even when keeping the inputs for checks failed
            await chain.close(keep=kept)
        if ended_well and builder.warm_up is not None:
            ctx.warm_ups.start(ctx, builder, list(chain.hops))
            started = True
    finally:
        if not started:  # a call waiting for this warm-up goes on at once
            ctx.warm_ups.forget(builder)


async def warm_up(ctx, builder, hops: list[Hop]) -> str:
    """Prefill the positions of `builder.warm_up`'s blocks past the prompt's kept ones on a fresh chain over `hops`
    and have them keep every block; how it ended (KEPT, FAILED or SKIPPED)."""
    call, blocks = builder.call, builder.warm_up
    positions = len(blocks.hashes) * blocks.block_tokens
    kept_tokens = len(builder.kept.hashes) * blocks.block_tokens if builder.kept is not None else 0
    switch = call.model.head.rope_switch_tokens
    if switch is not None and (positions > switch) != (len(call.prompt_ids) > switch):
        return SKIPPED  # these positions would rotate on the other factor set than the blocks' names say
    if any(ctx.load.refused_recently(hop.shard_id) for hop in hops):
        return SKIPPED
    # A pipeline of its own: the call's hops may still be closing its session, which a reopen would cut short.
    chain = builder.over(hops, pipeline_id=new_pipeline_id())
    held: list[str] = []
    keep = None
    try:
        failure = await chain.open()
        if failure is not None:
            if failure.code == "at_capacity":
                ctx.load.refused(failure.shard_id)
                return SKIPPED
            return FAILED
        held = chain.shard_ids
        ctx.load.hold(held)
        start = chain.take_reused_tokens()
        if start != kept_tokens:  # a hop lost the prompt's blocks: warming up would mean prefilling it all again
            return FAILED
        hidden = await on_compute_thread(call.model.head.embed, call.known_ids[start:positions])
        output = await prefill(chain, hidden, ctx.settings.orchestrator.prefill_chunk_tokens, start=start)
        if isinstance(output, StepFailure):
            log.info("pipeline %s: its answer's warm-up failed: %s", call.pipeline_id, output)
            return FAILED
        await keep_chain_inputs(ctx.kept_inputs, chain, blocks)
        keep = blocks
        return KEPT
    finally:
        try:
            # Shielded: a warm-up cancelled (its timeout, shutdown) still frees its hops' sessions.
            await asyncio.shield(chain.close(keep=keep))
        finally:
            if held:
                ctx.load.release(held)
        if keep is not None:
            ctx.kept_chains.remember(keep.hashes, hop_ranges(hops))
