"""Mirror: a second replica running exactly one hop's layers on that hop's recorded inputs, so that its outputs can
be compared with what the hop sent on (hearth/services/orchestrator/verification.py), or on a canary's inputs
(hearth/services/orchestrator/canaries.py).

A mirror is an ordinary pipeline session on the replica, placed where the checked hop sits (the same hop index,
hop count and neighbouring nodes, its own random pipeline id, link keys, sealing and limits as any call's), fed
from where it stopped, so each position runs once however often the hop is checked. A check feeds it in prefill
chunks (a catch-up of many positions costs the replica a fraction of what one decode step each would); a canary
replays the steps as the call sent them (prefill chunks, then one decode step per position), so that the host it
tests cannot tell it from a call's hop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import torch
from nats.aio.client import Client as NatsClient

from hearth.inference.activation_compare import looser_dtype
from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import PrefixBlocks
from hearth.protocol.quarantine import Held
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.call import new_pipeline_id
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.hop_owner import OpenSigner
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.orchestrator.placement import ChainPlacement
from hearth.services.orchestrator.prefill import prompt_ends, steps_as_sent
from hearth.services.orchestrator.kept_inputs import first_blocks
from hearth.services.orchestrator.recording import ChainRecorder, HopSpan
from hearth.services.orchestrator.router import Hop
from hearth.services.transport import FrameKind

log = logging.getLogger(__name__)


class Mirror:
    """One replica's session over one hop's layers; `fed_pos`: the positions it has run so far."""

    def __init__(self, nc: NatsClient, replica: Hop, *, node_id: str, model_id: str, weights_sha256: str,
                 transport: TransportSettings, wire_dtype: str, hidden_size: int, max_session_tokens: int,
                 chunk_tokens: int, dtype: str, placement: ChainPlacement | None = None,
                 sign_open: OpenSigner | None = None, prefix: PrefixBlocks | None = None) -> None:
        self.replica = replica
        self.dtype = dtype
        self.chunk_tokens = chunk_tokens
        self.fed_pos = 0
        # The recorder generation it was fed from: a re-prefill of the checked chain voids what it ran.
        self.generation: int | None = None
        self.chain = HopChain(nc, new_pipeline_id(), [replica], node_id=node_id,
                              model_id=model_id, weights_sha256=weights_sha256, transport=transport,
                              wire_dtype=wire_dtype, hidden_size=hidden_size, max_session_tokens=max_session_tokens,
                              placement=placement, sign_open=sign_open, prefix=prefix)

    @property
    def shard_id(self) -> str:
        return self.replica.shard_id

    async def open(self) -> StepFailure | None:
        return await self.chain.open()

    async def run(self, inputs: torch.Tensor, first_pos: int, kinds: Sequence[FrameKind] = (),
                  prompt_tokens: int | None = None, *, paced_by: Sequence[float] = (),
                  longest_wait_s: float = 0.0) -> torch.Tensor | StepFailure:
        """Run `inputs` ([1, positions, hidden], from `first_pos` = `fed_pos`) through the replica's layers, each
        position as the kind of step that ran it on the checked hop (`kinds`; prefill when not given): prefill and
        replay positions in chunks of one kind (prefill chunks for a replica that takes no replay steps), decode
        positions one step each, as a call sends them; prefill chunks told `prompt_tokens` as their prompt's length
        (the end of their run when not given); each step sent no sooner after the first than the call sent it
        (`paced_by`: per position, when the call sent it; each wait at most `longest_wait_s`). The outputs for
        every position, or why they did not come."""
        if first_pos != self.fed_pos:
            raise ValueError(f"a mirror fed up to position {self.fed_pos} cannot run from {first_pos}")
        if not self.chain.replay_steps:
            kinds = [FrameKind.prefill if kind is FrameKind.replay else kind for kind in kinds]
        outputs = []
        steps = steps_as_sent(int(inputs.shape[1]), kinds, self.chunk_tokens)
        began = time.monotonic()
        for (start, end, kind), prompt_end in zip(steps, prompt_ends(steps), strict=True):
            if start < len(paced_by):
                due_s = began + paced_by[start] - paced_by[0] - time.monotonic()
                if due_s > 0:
                    await asyncio.sleep(min(due_s, longest_wait_s))
            told = None if prompt_end is None else max(prompt_tokens or 0, first_pos + prompt_end)
            output = await self.chain.step(kind, first_pos + start, inputs[:, start:end].contiguous(), told)
            if isinstance(output, StepFailure):
                return output
            outputs.append(output)
            self.fed_pos = first_pos + end
        return torch.cat(outputs, dim=1)

    async def check(self, span: HopSpan) -> torch.Tensor | StepFailure:
        """Run a checked hop's `span` (from `fed_pos`): its prefill positions as the hop ran them, the positions it
        decoded one by one as replay steps, chunked, which compute each as its decode step did (and rotate each at
        its own length: hearth/inference/layer_call.py); on a replica that takes no replay steps, as decode steps
        again (a prefill chunk would rotate them all at the chunk's length)."""
        replay = self.chain.replay_steps
        kinds = [FrameKind.replay if kind is FrameKind.decode and replay else kind for kind in span.kinds]
        return await self.run(span.inputs, span.first_pos, kinds, span.prompt_tokens)

    async def close(self) -> None:
        await self.chain.close()

    async def witness(self, recorder: ChainRecorder, index: int, span: HopSpan):
        """As a fresh third replica (fed a kept prefix's positions already, where the hop began from one): run hop
        `index`'s recorded inputs from there through `span`; (self, its outputs over `span`), or None (then closed)
        when they did not come."""
        first_pos = self.fed_pos
        history = recorder.span(index, first_pos, span.last_step)
        try:
            output = await self.check(history) if history is not None else None
        except BaseException:  # cancelled (the call's checks ended): nobody else holds this fresh witness
            await asyncio.shield(self.close())
            raise
        if output is None or isinstance(output, StepFailure):
            await self.close()
            return None
        return self, output[:, span.first_pos - first_pos:span.end_pos - first_pos]


async def _feed_kept_prefix(ctx, call, chain: HopChain, index: int, mirror: Mirror) -> StepFailure | None:
    """A hop that began from a kept prefix is mirrored from the same positions: the mirror first runs what entered
    the hop's first layer there (hearth/services/orchestrator/kept_inputs.py); why it cannot, or None."""
    reused = chain.reused_tokens
    if reused == 0 or chain.prefix is None:
        return None
    layer = chain.hops[index].layer_lo_to_run
    if layer == 0:
        inputs = await on_compute_thread(call.model.head.embed, call.known_ids[:reused])
    else:
        inputs = ctx.kept_inputs.inputs(first_blocks(chain.prefix, reused), layer)
    if inputs is None:
        return StepFailure("refused", mirror.shard_id, f"what entered layer {layer} over the {reused} kept positions "
                                                       f"hop {index} began from is no longer held here")
    output = await mirror.run(inputs, 0, prompt_tokens=len(call.prompt_ids))  # a prefix of the call's prompt's side
    return output if isinstance(output, StepFailure) else None


def serves_range(candidate, weights_sha256: str, quantization: str, dtype: str | None, layer_lo: int,
                 layer_hi: int) -> bool:
    """Whether `candidate` (a routing ShardCandidate) computes layers `layer_lo`..`layer_hi` as another replica
    would: the same weights and scheme, its range covering them, and the dtype `dtype` (None: any)."""
    return (candidate.weights_sha256 == weights_sha256 and candidate.quantization == quantization
            and dtype in (None, candidate.dtype) and candidate.layer_lo <= layer_lo and layer_hi <= candidate.layer_hi)


async def open_mirror(ctx, call, chain: HopChain, index: int, avoid: set[str],
                      chance: random.Random) -> Mirror | None:
    """A mirror of hop `index` of `call`'s `chain` on a live replica running exactly its layers (same weights, scheme
    and dtype) on another node, none of `avoid` nor quarantined, nor on a quarantined shard's node (`ctx`: the call's
    RunContext); None when there is none."""
    hop = chain.hops[index]
    candidates = await asyncio.to_thread(ctx.router.candidates, call.model.model_id)
    by_id = {c.shard_id: c for c in candidates}
    # Independent parties only: a host serving two replicas cannot vouch for itself.
    busy_nodes = {by_id[shard].node_id for shard in avoid | {hop.shard_id} if shard in by_id}
    dtype = by_id[hop.shard_id].dtype if hop.shard_id in by_id else None
    now = ctx.router.now()
    held = Held.of(ctx.quarantined)
    # A replica of any dtype: the hop's own label must not decide whether it is checked (a label no replica has
    # would leave it unchecked); the check judges by the looser of the two dtypes' tolerances.
    replicas = [c for c in candidates if c.shard_id not in avoid and c.node_id not in busy_nodes
                and not held.holds(c.shard_id, c.node_id) and ctx.router.alive(c, now)
                and serves_range(c, call.model.weights_sha256, hop.quantization, None, hop.layer_lo_to_run,
                                 hop.layer_hi_to_run)]
    chance.shuffle(replicas)
    replicas.sort(key=lambda replica: replica.dtype != dtype)  # the hop's own dtype first: the tighter check
    settings, model = ctx.settings, call.model
    for replica in replicas:
        on_replica = Hop(shard_id=replica.shard_id, control_subject=replica.control_subject, node_id=replica.node_id,
                         layer_lo_to_run=hop.layer_lo_to_run, layer_hi_to_run=hop.layer_hi_to_run,
                         quantization=hop.quantization)
        mirror = Mirror(ctx.nc, on_replica, node_id=ctx.node_id, model_id=model.model_id,
                        weights_sha256=model.weights_sha256, transport=settings.transport,
                        wire_dtype=chain.wire_dtype, hidden_size=model.head.info.hidden_size,
                        max_session_tokens=chain.max_session_tokens or len(call.prompt_ids) + 1,
                        chunk_tokens=settings.orchestrator.prefill_chunk_tokens,
                        dtype=looser_dtype(dtype, replica.dtype), placement=ChainPlacement.of_hop(chain.hops, index),
                        sign_open=chain.sign_open)
        try:
            failure = await mirror.open()
            if failure is None:
                failure = await _feed_kept_prefix(ctx, call, chain, index, mirror)
        except BaseException:
            # Cancelled (the call's checks ended) or failed while opening: nobody else holds it to close it.
            await asyncio.shield(mirror.close())
            raise
        if failure is None:
            mirror.generation = chain.recorder.generation
            return mirror
        log.info("pipeline %s: replica %s would not mirror hop %d: %s", call.pipeline_id, replica.shard_id, index,
                 failure)
        await mirror.close()
    return None
