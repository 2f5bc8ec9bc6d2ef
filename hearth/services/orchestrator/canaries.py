"""Canaries: work whose honest outputs are known (a check confirmed them: two hosts agreed) replayed from time to
time to another host of the same layers, as a session it cannot tell from a call's hop, and compared (EdgeLlama's
fortification check). A host is only ever sent work recorded from other hosts that no shard of its node saw (nor
sent to the hop), in a session as long as the hop's, so that nothing tells it the work is a replay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import torch

from hearth.events.streams import MiB
from hearth.events.models import (IntegrityMismatchConfirmed, IntegrityMismatchDisputed, IntegrityShardsVerified,
                                  ShardVerification)
from hearth.inference.activation_compare import (evidence_digest, first_mismatch, position_errors, reportable_error,
                                          tolerance_for)
from hearth.protocol.control import PrefixBlocks
from hearth.protocol.quarantine import Held
from hearth.services.common.lifecycle import log_failure
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.guards import RangeKey
from hearth.services.orchestrator.metrics import verification_checks_total
from hearth.services.orchestrator.mirror import Mirror, serves_range
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.placement import ChainPlacement
from hearth.services.orchestrator.recording import HopSpan
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind
from hearth.services.transport.keepalives import telling_while

log = logging.getLogger(__name__)

# Third hosts asked to settle a canary answered otherwise, one after another until one answers.
witness_tries = 2


@dataclass(frozen=True)
class Canary:
    """A confirmed run of one hop from position 0: its inputs, outputs and step kinds, where the hop sat, and the
    two hosts whose outputs agreed on it."""

    key: RangeKey
    weights_sha256: str
    dtype: str
    wire_dtype: str
    placement: ChainPlacement
    kinds: tuple[FrameKind, ...]
    inputs: torch.Tensor
    outputs: torch.Tensor
    parties: tuple[str, str]
    # The prompt length its prefill chunks were told (Hearth-Prompt-Tokens): a canary cut inside a long prompt
    # still tells the whole one, as the hop was told, since a LongRoPE model rotates by it.
    prompt_tokens: int | None = None
    # The session length the hop was opened with (the call's prompt and max_tokens): a canary opens its host's
    # session as long, since one only as long as its prompt (no room to decode) is one no call opens.
    session_tokens: int | None = None
    # The nodes that saw its inputs (the hop's, every mirror's, the one that sent them to the hop) or were named as
    # its neighbours: none of them is sent it, since a liar could recognise the work and answer just that honestly.
    seen_by_nodes: frozenset[str] = frozenset()
    # When the call sent the step that ran each position (monotonic s): replayed no faster, since a call's hop gets
    # its next decode step only after the rest of the chain and the sampling.
    sent_at: tuple[float, ...] = ()
    # (tokens per block, blocks) of the kept-prefix names the hop's open carried, None when it named none: a canary
    # names as many, fresh, since an open that names none where calls do would give it away.
    named_blocks: tuple[int, int] | None = None

    @property
    def positions(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.inputs, self.outputs))


def confirmed_canary(key: RangeKey, weights_sha256: str, chain: HopChain, index: int, span: HopSpan,
                     mirrors: list[Mirror]) -> Canary:
    """The canary a check of hop `index` of `chain` that every mirror confirmed over `span` (from position 0)
    makes."""
    hop, placement = chain.hops[index], ChainPlacement.of_hop(chain.hops, index)
    seen_by = {hop.node_id, placement.upstream_node, placement.downstream_node,
               *(mirror.replica.node_id for mirror in mirrors)} - {None}
    return Canary(key, weights_sha256, mirrors[0].dtype, chain.wire_dtype, placement, span.kinds, span.inputs,
                  span.outputs, (hop.shard_id, mirrors[0].shard_id), span.prompt_tokens,
                  session_tokens=chain.max_session_tokens, seen_by_nodes=frozenset(seen_by), sent_at=span.sent_at,
                  named_blocks=None if chain.prefix is None else (chain.prefix.block_tokens, len(chain.prefix.hashes)))


def fresh_names(block_tokens: int, blocks: int) -> PrefixBlocks:
    """`blocks` block names no host keeps, of the form a call's are (random 128-bit digests)."""
    return PrefixBlocks(block_tokens=block_tokens, hashes=[secrets.token_hex(16) for _ in range(blocks)])


class CanaryLibrary:
    """A few canaries per layer range (a new one replaces a random old one), each cut to `max_positions`, all of them
    within `budget_bytes` (random ones of any range dropped beyond it: the ranges calls run are as many as the ranges
    shards advertise, which no budget per range bounds)."""

    def __init__(self, per_range: int, max_positions: int, budget_bytes: int | None = None) -> None:
        self.per_range = per_range
        self.max_positions = max_positions
        self.budget_bytes = budget_bytes
        self._kept: dict[RangeKey, list[Canary]] = {}
        self._chance = random.SystemRandom()

    @classmethod
    def configured(cls, verification) -> "CanaryLibrary":
        """The library as `[verification]` (canaries_per_range, canary_max_positions, canary_memory_mb) sizes it."""
        return cls(verification.canaries_per_range, verification.canary_max_positions,
                   int(verification.canary_memory_mb * MiB))

    @property
    def total_bytes(self) -> int:
        return sum(canary.nbytes for canary in self.all())

    def keep(self, canary: Canary) -> None:
        if self.per_range == 0:
            return
        cut = min(canary.positions, self.max_positions)
        canary = replace(canary, kinds=canary.kinds[:cut], inputs=canary.inputs[:, :cut].clone(),
                         outputs=canary.outputs[:, :cut].clone(), sent_at=canary.sent_at[:cut])
        if self.budget_bytes is not None and canary.nbytes > self.budget_bytes:
            return  # one beyond the whole budget would push out every other canary, then itself
        kept = self._kept.setdefault(canary.key, [])
        if len(kept) < self.per_range:
            kept.append(canary)
        else:
            kept[self._chance.randrange(len(kept))] = canary
        while self.budget_bytes is not None and self.total_bytes > self.budget_bytes:
            self._drop_one_but(canary)

    def all(self) -> list[Canary]:
        return [canary for kept in self._kept.values() for canary in kept]

    def drop(self, canary: Canary) -> None:
        """Replay `canary` no more (a witness contradicted it)."""
        kept = [other for other in self._kept.get(canary.key, []) if other is not canary]  # by identity: tensors
        if kept:
            self._kept[canary.key] = kept
        else:
            self._kept.pop(canary.key, None)

    def _drop_one_but(self, newest: Canary) -> None:
        key, index = self._chance.choice([(key, index) for key, kept in self._kept.items()
                                          for index, canary in enumerate(kept) if canary is not newest])
        del self._kept[key][index]
        if not self._kept[key]:
            del self._kept[key]


class CanaryRunner:
    """Every `[verification] canary_interval_s` (jittered), replays one canary to one host that did not record it;
    a host that answers it wrongly is quarantined with the canary's two parties as witnesses, unless a third host
    (a witness) answers otherwise than those two (then the canary is dropped and nobody blamed)."""

    def __init__(self, ctx, record: Callable[[object], Awaitable[None]]) -> None:
        self.ctx = ctx
        self._record = record
        self._chance = random.SystemRandom()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.ctx.settings.verification.canary_interval_s > 0:
            self._task = asyncio.create_task(self._run(), name="canaries")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        interval_s = self.ctx.settings.verification.canary_interval_s
        while True:
            await asyncio.sleep(interval_s * self._chance.uniform(0.5, 1.5))
            try:
                await self.replay_one()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a canary must never take the orchestrator down; its text may quote one
                log_failure(log, "replaying a canary", error)

    async def replay_one(self) -> str | None:
        """Replay one canary to one eligible host; the host's shard id (None when no pair was eligible)."""
        pairs = [(canary, host) for canary in self.ctx.canaries.all() for host in await self._hosts(canary)]
        if not pairs:
            return None
        canary, host = self._chance.choice(pairs)
        await self._replay(canary, host)
        return host.shard_id

    async def _hosts(self, canary: Canary) -> list[Hop]:
        model_id, lo, hi, quantization = canary.key
        candidates = await asyncio.to_thread(self.ctx.router.candidates, model_id)
        now = self.ctx.router.now()
        held = Held.of(self.ctx.quarantined)
        return [Hop(shard_id=c.shard_id, control_subject=c.control_subject, node_id=c.node_id, layer_lo_to_run=lo,
                    layer_hi_to_run=hi, quantization=quantization)
                for c in candidates
                if c.shard_id not in canary.parties and c.node_id not in canary.seen_by_nodes
                and not held.holds(c.shard_id, c.node_id)
                and self.ctx.router.alive(c, now)
                and serves_range(c, canary.weights_sha256, quantization, canary.dtype, lo, hi)]

    async def _replay(self, canary: Canary, host: Hop) -> None:
        output, pipeline_id = await self._answer(canary, host)
        if isinstance(output, StepFailure):
            log.info("canary to %s did not come back: %s", host.shard_id, output)
            return
        tolerance = tolerance_for(None, canary.dtype, canary.key[3], canary.wire_dtype)
        errors = position_errors(output, canary.outputs)
        bad = first_mismatch(errors, tolerance)
        if bad is None:
            verification_checks_total.labels("canary_confirmed").inc()
            await self._record(IntegrityShardsVerified(node_id=self.ctx.node_id, pipeline_id=pipeline_id, shards=[
                ShardVerification(shard_id=host.shard_id, checks=1, verified_positions=canary.positions)]))
            return
        evidence = dict(node_id=self.ctx.node_id, pipeline_id=pipeline_id, layer_lo=canary.key[1],
                        layer_hi=canary.key[2], quantization=canary.key[3], dtype=canary.dtype, position=bad,
                        step_kind=canary.kinds[bad].value, relative_error=reportable_error(errors[bad]),
                        tolerance=tolerance, evidence_sha256=evidence_digest(canary.inputs, output, canary.outputs))
        # The canary's two parties (a call's hop and its mirror) may have agreed on a lie, colluding: a third host
        # settles it where one answers (else the two parties' word stands), lest a lie kept as a canary get every
        # honest host it is replayed to quarantined.
        witness = await self._witness(canary, host)
        if witness is not None:
            witness_id, witnessed = witness
            sides_with_canary = first_mismatch(position_errors(witnessed, canary.outputs), tolerance) is None
            if not sides_with_canary or first_mismatch(position_errors(witnessed, output), tolerance) is None:
                log.warning("%s answered a canary of layers %d-%d otherwise than its parties %s, and witness %s "
                            "did not side with them; the canary is dropped, nobody blamed", host.shard_id,
                            canary.key[1], canary.key[2], ", ".join(canary.parties), witness_id)
                verification_checks_total.labels("disputed").inc()
                self.ctx.canaries.drop(canary)
                await self._record(IntegrityMismatchDisputed(shard_ids=[host.shard_id, canary.parties[0]],
                                                             **evidence))
                return
        witnesses = [*canary.parties, *([witness[0]] if witness is not None else [])]
        log.warning("%s answered a canary of layers %d-%d wrongly (position %d, relative error %.3g; witnesses %s); "
                    "quarantined", host.shard_id, canary.key[1], canary.key[2], bad, float(errors[bad]),
                    ", ".join(witnesses))
        verification_checks_total.labels("canary_mismatch").inc()
        self.ctx.prove_wrong(host.shard_id)
        await self._record(IntegrityMismatchConfirmed(shard_id=host.shard_id, witnesses=witnesses, **evidence))

    async def _witness(self, canary: Canary, host: Hop) -> tuple[str, torch.Tensor] | None:
        """A third host's answer to `canary` (one on another node than `host`'s that never saw it either): (its
        shard id, its outputs), or None when none answered."""
        candidates = [other for other in await self._hosts(canary) if other.node_id != host.node_id]
        self._chance.shuffle(candidates)
        for candidate in candidates[:witness_tries]:
            output, _ = await self._answer(canary, candidate)
            if not isinstance(output, StepFailure):
                return candidate.shard_id, output
            log.info("canary witness %s did not answer: %s", candidate.shard_id, output)
        return None

    async def _answer(self, canary: Canary, host: Hop) -> tuple[torch.Tensor | StepFailure, str]:
        """`host`'s outputs for `canary`'s inputs, or why they did not come; and the session's pipeline id."""
        settings = self.ctx.settings
        # As long as the hop's session was (a host refuses a prompt length beyond its session's).
        session_tokens = max(canary.positions, canary.prompt_tokens or 0, canary.session_tokens or 0)
        mirror = Mirror(self.ctx.nc, host, node_id=self.ctx.node_id, model_id=canary.key[0],
                        weights_sha256=canary.weights_sha256, transport=settings.transport,
                        wire_dtype=canary.wire_dtype, hidden_size=int(canary.inputs.shape[-1]),
                        max_session_tokens=session_tokens, chunk_tokens=settings.orchestrator.prefill_chunk_tokens,
                        dtype=canary.dtype, placement=canary.placement, sign_open=self.ctx.open_signer,
                        prefix=fresh_names(*canary.named_blocks) if canary.named_blocks is not None else None)
        try:
            failure = await mirror.open()
            # Told it lives as a call's hops are (every keepalive_interval_s): a session without is no call's.
            output = failure if failure is not None else await telling_while(
                asyncio.ensure_future(mirror.run(canary.inputs, 0, canary.kinds, canary.prompt_tokens,
                                                 paced_by=canary.sent_at,
                                                 longest_wait_s=settings.transport.step_timeout_s)),
                mirror.chain.keep_alive, settings.transport.keepalive_interval_s)
        finally:
            await mirror.close()
        return output, mirror.chain.pipeline_id
