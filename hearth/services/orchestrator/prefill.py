"""Chunked prefill: a call's prompt goes through its chain in chunks of `prefill_chunk_tokens`, pipelined.

Why chunks: a shard runs the steps of all its sessions one at a time, in arrival order (one compute thread, each
hop hands it one step at a time; hearth/services/shard/hops.py). A 4 000-token prompt in one step would hold every shard
for its whole prefill while other sessions' tokens wait; cut into chunks, another session's decode step waits at
most one chunk.

Why pipelined: chunk k+1 is sent into hop 0 while chunk k is still in later hops, so with h hops up to h chunks
compute at once (hop 1 on chunk k while hop 0 runs chunk k+1), which also shortens the long prompt's own time to
first token. At most `hops + 1` chunks are out at once (and never more than a receiver holds ready,
`max_ready_steps`): enough to keep every hop busy, few enough that a chunk's timeout stays bounded. A call that
checks its hops may hold a chunk back until the checks of those before made it room in the chain's bounded record
(`make_room`: CallVerifier.make_room), so a prompt longer than the record holds is checked as it streams.

The transport keeps them in order: one sender per link publishes whole steps in call order, and NATS delivers a
connection's messages on a subject in order, so every hop (and the sink) sees chunk k complete before chunk k+1.
Only the last chunk's output matters (the sampler reads its last position); the others are read and dropped. A
failure of any chunk fails the prefill; the caller re-prefills from position 0
(hearth/services/orchestrator/pipeline.py) and the chunks still out on the old chain are stale (HopChain ignores their
notices and outputs).

Why replay steps: a re-prefill (after a failover, an eviction or a broker outage) sends the prompt in the chunks its
first prefill had and the tokens the call decoded as `replay` steps, in which each query attends as its decode step
did. A prefill's attention sums its keys in another order than one query's, and a quantized layer can round that
difference up to a whole level; replayed, every hop rebuilds the cache and outputs the first chain computed, so the
call goes on with the tokens an uninterrupted run would give (BENCHMARKS.md, "Failover").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import torch

from hearth.services.orchestrator.chain import HopChain, SentStep
from hearth.services.orchestrator.local_chain import LocalChain
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.transport import FrameKind


def chunk_spans(total_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a `total_tokens` prompt; one span when `chunk_tokens` is 0 (no chunking)."""
    if total_tokens < 1:
        raise ValueError(f"a prefill needs at least one token, got {total_tokens}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be 0 (no chunking) or positive, got {chunk_tokens}")
    size = chunk_tokens or total_tokens
    return [(start, min(start + size, total_tokens)) for start in range(0, total_tokens, size)]


def chunks_in_flight(hop_count: int, max_ready_steps: int) -> int:
    """How many chunks a chain of `hop_count` hops gets at once (see the module docstring)."""
    return max(1, min(hop_count + 1, max_ready_steps))


def steps_as_sent(positions: int, kinds: Sequence[FrameKind], chunk_tokens: int) -> list[tuple[int, int, FrameKind]]:
    """[start, end) and kind of each step that runs `positions` positions of kinds `kinds` (prefill past their end)
    as a call sends them: a decode step per decode position, runs of prefill or of replay positions in chunks of at
    most `chunk_tokens` (0: no limit; chunk_spans)."""
    def kind_at(position: int) -> FrameKind:
        return kinds[position] if position < len(kinds) else FrameKind.prefill

    steps: list[tuple[int, int, FrameKind]] = []
    start = 0
    while start < positions:
        kind = kind_at(start)
        end = start + 1
        if kind is FrameKind.decode:
            steps.append((start, end, kind))
        else:
            while end < positions and kind_at(end) is kind:
                end += 1
            steps += [(start + lo, start + hi, kind) for lo, hi in chunk_spans(end - start, chunk_tokens)]
        start = end
    return steps


def prompt_ends(steps: Sequence[tuple[int, int, FrameKind]]) -> list[int | None]:
    """Per step of `steps` (steps_as_sent's), the end of the run of prefill positions a prefill step is a chunk of:
    the prompt's length, which each of its chunks carries (Hearth-Prompt-Tokens: they rotate as the whole prompt);
    None for the other kinds."""
    ends: list[int | None] = [None] * len(steps)
    run_end = None
    for index in reversed(range(len(steps))):
        _, end, kind = steps[index]
        run_end = (run_end or end) if kind is FrameKind.prefill else None
        ends[index] = run_end
    return ends


def step_spans(total_tokens: int, chunk_tokens: int, start: int = 0,
               replay_from: int | None = None) -> list[tuple[int, int, FrameKind]]:
    """[start, end) (relative to `start`) and kind of each step that prefills `total_tokens` tokens from position
    `start`: those before position `replay_from` (the prompt) in `prefill` chunks, those from it on (tokens the call
    decoded, sent again after a failover) in `replay` chunks, so every hop rebuilds the cache the first chain built."""
    prompt_end = total_tokens if replay_from is None else min(total_tokens, max(0, replay_from - start))
    kinds = [FrameKind.prefill] * prompt_end + [FrameKind.replay] * (total_tokens - prompt_end)
    return steps_as_sent(total_tokens, kinds, chunk_tokens)


# Before a chunk goes out: True to send it, False to take the output of a chunk out first (there are some), or the
# failure that ends the prefill (CallVerifier.make_room: a long prompt's checks as it streams).
MakeRoom = Callable[[torch.Tensor, bool], Awaitable["bool | StepFailure"]]


async def prefill(chain: HopChain | LocalChain, hidden: torch.Tensor, chunk_tokens: int,
                  start: int = 0, replay_from: int | None = None,
                  make_room: MakeRoom | None = None) -> torch.Tensor | StepFailure:
    """Prefill `hidden` ([1, tokens, hidden], positions from `start`: the chain's hops hold those before) through
    `chain` in chunks, positions from `replay_from` on as replay steps where every hop takes them (step_spans), as
    prefill chunks where one does not, each sent once `make_room` lets it; the last chunk's output, or the failure
    that stopped it."""
    spans = step_spans(int(hidden.shape[1]), chunk_tokens, start, replay_from if chain.replay_steps else None)
    prompt_tokens = [None if end is None else start + end for end in prompt_ends(spans)]
    if len(spans) == 1:
        room = True if make_room is None else await make_room(hidden, False)
        if isinstance(room, StepFailure):
            return room
        return await chain.step(spans[0][2], start, hidden, prompt_tokens[0])
    if isinstance(chain, LocalChain):
        # One compute-thread trip per chunk: the orchestrator's other calls get the thread in between.
        output = None
        for (first, end, kind), prompt in zip(spans, prompt_tokens, strict=True):
            output = await chain.step(kind, start + first, hidden[:, first:end], prompt)
            if isinstance(output, StepFailure):
                return output
        return output
    depth = chunks_in_flight(len(chain.hops), chain.transport.max_ready_steps)
    out: deque[tuple[SentStep, int]] = deque()
    next_span = 0
    while True:
        while next_span < len(spans) and len(out) < depth:
            first, end, kind = spans[next_span]
            chunk = hidden[:, first:end].contiguous()
            room = True if make_room is None else await make_room(chunk, bool(out))
            if isinstance(room, StepFailure):
                return room
            if not room:
                break
            sent = await chain.send_step(kind, start + first, chunk,
                                         queued_tokens=sum(tokens for _, tokens in out),
                                         prompt_tokens=prompt_tokens[next_span])
            if isinstance(sent, StepFailure):
                return sent
            out.append((sent, end - first))
            next_span += 1
        oldest, _ = out.popleft()
        output = await chain.await_step(oldest)
        if isinstance(output, StepFailure) or (not out and next_span == len(spans)):
            return output
