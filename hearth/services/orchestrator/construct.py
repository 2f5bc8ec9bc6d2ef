"""ChainBuilder: opens a call's chain of shard hops over what the router plans, routing around the shards that
refuse it and waiting while the shards that could serve it are full.

The router is asked once per construction: one read of the candidates, then every refusal while opening is
routed around in memory on the same rows (ShardRouter.plan); a second read comes only after catching up with the
event log, when the first rows could not cover the model. With kept prefixes on, the same construction looks the
call's block names up in our own memory of kept chains and in the read model (what every orchestrator's calls kept,
hearth/services/orchestrator/affinity.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from hearth.events.models import KeptHop, KeptMark, KeptPrefix
from hearth.events.streams import MiB

from hearth.protocol.control import PrefixBlocks
from hearth.readmodels.queries import KeptChain, kept_chain_holding
from hearth.services.orchestrator.affinity import hop_ranges, longer_kept, prefer_kept
from hearth.services.orchestrator.call import Call
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.check_policy import MIRRORS_PER_LEVEL
from hearth.protocol.quarantine import Held
from hearth.services.orchestrator.context import RunContext
from hearth.services.orchestrator.prefix import (
    CallPrefix,
    caller_scope,
    first_name,
    kept_marks,
    public_blocks_of,
    published_mark,
)
from hearth.services.orchestrator.recovery import SHARD_UNAVAILABLE
from hearth.services.orchestrator.router import Hop, RoutingError
from hearth.services.transport.integrity import NormBounds
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)

PROVED_WRONG = "a check proved it wrong"


class ChainBuilder:
    """Builds the chains of one call (its first, and each failover's), over the call's exclusions."""

    def __init__(self, call: Call, ctx: RunContext, *, record: bool = False) -> None:
        self.call = call
        self.ctx = ctx
        # What its chains may hold of their hops' work for checks (hearth/services/orchestrator/recording.py; None:
        # none).
        self.record_budget_bytes = int(ctx.settings.verification.record_budget_mb * MiB) if record else None
        # Whole blocks of the prompt inside a public system prompt (hearth/services/orchestrator/prefix.py); set by
        # build.
        self.public_blocks = 0
        # Per scheme: the chain the read model says keeps most of the call's leading blocks; set by build.
        self.recorded_kept: dict[str, KeptChain] = {}
        # The blocks the call's last chain keeps once it ended well (keep_on_completion), for its close: the prompt's,
        # which a prefill computed; and those of every position it ran, for the answer's warm-up (answer_kv.py).
        self.kept: PrefixBlocks | None = None
        self.warm_up: PrefixBlocks | None = None

    async def build(self) -> HopChain:
        """An open chain over what the router plans, routing around refusals and waiting while the shards that
        could serve are full; RoutingError when nothing covers the model any more (or room never came)."""
        call = self.call
        started = time.perf_counter()
        router, model_id = self.ctx.router, call.model.model_id
        self.public_blocks = await self._public_blocks()
        if self.ctx.quarantined:
            # Shards our checks proved wrong that the read model quarantines now are its to hold from here on (each
            # looked up itself, whether advertised or not), so a steward's clearing lifts them.
            self.ctx.quarantined -= await asyncio.to_thread(router.quarantined, set(self.ctx.quarantined))
        candidates = await asyncio.to_thread(router.candidates, model_id)
        # A conversation's next turn sent at once: the blocks of the answer before it may be on their way in.
        reusable = self._reusable_by_scheme(candidates)
        await self.ctx.warm_ups.settle(name for blocks in reusable.values() for name in blocks.hashes)
        self.recorded_kept = await self._recorded_kept(reusable)
        caught_up = rechecked = False
        silent: set[str] = set()  # shards this construction routed around for "no responders"
        while True:
            try:
                hops = self._plan(candidates, load=self.ctx.load)
            except RoutingError:
                if not caught_up:
                    # The read model may trail the event log by milliseconds (a shard that just advertised):
                    # decide "unavailable" only on a caught-up one.
                    await self._catch_up()
                    candidates, caught_up = await asyncio.to_thread(router.candidates, model_id), True
                    continue
                if silent and not rechecked:
                    # "No responders" is also a live shard between two broker nodes (one restarting, a route
                    # re-forming): before answering unavailable, give the silent ones one more try after a pause.
                    rechecked = True
                    await asyncio.sleep(self.ctx.settings.orchestrator.silent_shard_recheck_s)
                    for shard_id in silent:
                        call.excluded.pop(shard_id, None)
                    candidates = await asyncio.to_thread(router.candidates, model_id)
                    continue
                if not self._only_room_lacks(candidates):
                    raise
                waited_s, settings = time.perf_counter() - started, self.ctx.settings.orchestrator
                if waited_s > settings.at_capacity_max_wait_s:
                    raise RoutingError("overloaded", f"no shard had room for this call within {waited_s:.0f} s "
                                                     f"(at_capacity_max_wait_s); retry later")
                await self.ctx.load.wait_for_room(settings.at_capacity_retry_s)
                candidates = await asyncio.to_thread(router.candidates, model_id)
                continue
            chain = self.over(hops)
            failure = await chain.open()
            if failure is None:
                call.construct_ms = (time.perf_counter() - started) * 1000.0
                # A failover's chain serves the same scheme, so greedy output stays identical.
                call.quantization = hops[0].quantization
                return chain
            await chain.close()
            if failure.shard_id is None:
                # Our broker connection failed under the open: nothing reached a hop, so once it is back the same
                # construction goes on.
                if failure.kind == "broker" and await self._broker_back(started):
                    continue
                raise RoutingError(SHARD_UNAVAILABLE, failure.reason)
            if failure.code == "at_capacity":
                # Full for now (another orchestrator's streams): a replica, or a wait; never a reason to fail.
                log.info("pipeline %s: %s; trying a replica or waiting", call.pipeline_id, failure)
                self.ctx.load.refused(failure.shard_id)
                continue
            log.info("pipeline %s: %s; routing around it", call.pipeline_id, failure)
            call.excluded[failure.shard_id] = failure.reason
            if failure.kind == "gone" and not rechecked:
                silent.add(failure.shard_id)

    async def _broker_back(self, started: float) -> bool:
        """Wait until our broker connection is up again, within `[orchestrator] broker_wait_s` of `started`."""
        settings, nc = self.ctx.settings, self.ctx.nc
        deadline = started + settings.orchestrator.broker_wait_s
        while time.perf_counter() < deadline:
            await asyncio.sleep(settings.nats.reconnect_wait_s)
            if nc.is_connected:
                return True
        return False

    def naming(self, quantization: str) -> CallPrefix | None:
        """How this call's blocks are named on chains of `quantization` (None: no kept prefixes at all)."""
        settings, call = self.ctx.settings, self.call
        if not settings.prefix_cache.enabled:
            return None
        bs = settings.prefix_cache.block_tokens
        wire_dtype = settings.research.distributed_inference.activation_dtype
        # A LongRoPE prompt rotates on its short or its long factors by its length: KV of one set serves no prompt of
        # the other.
        switch = call.model.head.rope_switch_tokens
        factors = "" if switch is None else ("long" if len(call.prompt_ids) > switch else "short")
        return CallPrefix(settings.prefix_cache, first_name(call.model.model_id, call.model.weights_sha256,
                                                            quantization, wire_dtype, bs, factors,
                                                            self._mark_keeper()),
                          caller_scope(call.caller), self.public_blocks,
                          reuse_allowed=call.request.params.verify not in ("all", "vote"))

    def keep_on_completion(self, chain: HopChain) -> KeptPrefix | None:
        """What `chain`'s hops keep of the call (which ended well): the prompt's whole blocks at its close (`kept`,
        remembered for routing), then, when `[prefix_cache] warm_up_answers`, those of every position it ran once
        the answer's warm-up prefilled them (`warm_up`: a decode step's KV is not a prefill's, so it is never kept,
        hearth/services/orchestrator/answer_kv.py); described for the call's `pipeline.completed` (so every
        orchestrator's read model knows where they are; the warm-up's blocks announced ahead: on a failed warm-up
        the same hops still hold the prompt's, which the marks name too)."""
        naming, call = self.naming(chain.hops[0].quantization), self.call
        ran = naming.kept(call.known_ids[:call.next_position]) if naming is not None else None
        if ran is None:
            self.kept = self.warm_up = None
            return None
        prompt_blocks = len(call.prompt_ids) // ran.block_tokens
        self.kept = PrefixBlocks(block_tokens=ran.block_tokens, hashes=ran.hashes[:prompt_blocks]) \
            if prompt_blocks else None
        # Not where reuse is not allowed (verify all, vote): no chain of the call's could begin from its blocks.
        self.warm_up = ran if naming.settings.warm_up_answers and naming.reuse_allowed and \
            len(ran.hashes) > prompt_blocks else None
        if self.warm_up is not None:
            self.ctx.warm_ups.expect(self, naming.settings.warm_up_timeout_s)
        announced = self.warm_up or self.kept
        if announced is None:
            return None
        hops = hop_ranges(chain.hops)
        if self.kept is not None:
            self.ctx.kept_chains.remember(self.kept.hashes, hops)
        marks = kept_marks(announced.hashes, prompt_blocks, self._mark_keeper())
        return KeptPrefix(hops=[KeptHop(shard_id=shard_id, layer_lo=lo, layer_hi=hi) for shard_id, lo, hi in hops],
                          marks=[KeptMark(blocks=blocks, name=name) for blocks, name in marks],
                          idle_s=self.ctx.settings.shard.prefix_cache_idle_s)

    def over(self, hops: list[Hop], pipeline_id: str | None = None) -> HopChain:
        """A chain (not opened yet) over exactly `hops` (as pipeline `pipeline_id`: by default the call's)."""
        model, settings = self.call.model, self.ctx.settings
        naming = self.naming(hops[0].quantization)
        # No step of this call reaches beyond its prompt plus max_tokens: every hop refuses frames that would.
        return HopChain(self.ctx.nc, pipeline_id or self.call.pipeline_id, hops, node_id=self.ctx.node_id,
                        model_id=model.model_id,
                        weights_sha256=model.weights_sha256, transport=settings.transport,
                        accusers=self.call.accusers,
                        wire_dtype=settings.research.distributed_inference.activation_dtype,
                        sink_bounds=self.ctx.sink_bounds.setdefault(model.model_id, NormBounds()),
                        hidden_size=model.head.info.hidden_size,
                        max_session_tokens=len(self.call.prompt_ids) + self.call.request.most_tokens,
                        on_round_trip=self.ctx.load.observe_round_trip, record_budget_bytes=self.record_budget_bytes,
                        prefix=self._reusable(naming), sign_open=self.ctx.open_signer,
                        why_not_a_member=self.ctx.router.why_not_a_member)

    def _mark_keeper(self) -> MemberKey | None:
        """Whose hops keep our calls' blocks, as marks are drawn: our member key (None on an open mesh, where shards
        do not tell openers apart)."""
        return self.ctx.outbox.signing_key

    def _reusable(self, naming: CallPrefix | None) -> PrefixBlocks | None:
        """The kept blocks a chain of the call may begin from: within its prompt, whose KV a prefill computed (a
        failover replays the positions past it as its decode steps computed them: prefill.py)."""
        known = self.call.known_ids[:len(self.call.prompt_ids) + 1]
        return naming.reusable(known) if naming is not None else None

    def _reusable_by_scheme(self, candidates) -> dict[str, PrefixBlocks]:
        """Per scheme the call may be served in, the kept blocks its chain may begin from."""
        by_scheme = {}
        for scheme in {c.quantization for c in candidates if c.weights_sha256 == self.call.model.weights_sha256}:
            reusable = self._reusable(self.naming(scheme))
            if reusable is not None:
                by_scheme[scheme] = reusable
        return by_scheme

    def _only_room_lacks(self, candidates) -> bool:
        """Whether a chain could be planned if every shard had room (then waiting for room is worth it)."""
        try:
            self._plan(candidates, load=None)
        except RoutingError:
            return False
        return True

    async def _catch_up(self) -> None:
        timeout_s = self.ctx.settings.orchestrator.catch_up_timeout_s
        try:
            await self.ctx.projector.wait_until_caught_up(timeout_s=timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("routing read model still behind the event log after %s s", timeout_s)

    def _plan(self, candidates, *, load: ShardLoad | None) -> list[Hop]:
        router, model, excluded = self.ctx.router, self.call.model, self.call.excluded
        # A chain its checks can be made on, where the call asks them (router.py rule 2).
        route = dict(now=router.now(), load=load, quantization=self.call.quantization,
                     model_layers=model.head.info.num_layers,
                     mirrors_per_hop=MIRRORS_PER_LEVEL[self.call.request.params.verify])
        # Shards a check proved wrong, and the other shards of their nodes, are out at once, until the read model
        # quarantines them too (handed over in `build`).
        held = Held.of(self.ctx.quarantined)
        excluded = {**{c.shard_id: held.node_reason(c.node_id) for c in candidates if c.node_id in held.nodes},
                    **dict.fromkeys(held.shard_ids, PROVED_WRONG), **excluded}
        penalised = self.ctx.recent_failures.current() - excluded.keys()
        if penalised:
            # Shards that just failed other requests are the last resort, not a reason to give up.
            avoided = {**excluded, **dict.fromkeys(penalised, "it failed another call just now")}
            try:
                hops = router.plan(candidates, model.model_id, model.weights_sha256, exclude=avoided, **route)
                return self._with_affinity(hops, candidates, avoided, load)
            except RoutingError:
                pass
        hops = router.plan(candidates, model.model_id, model.weights_sha256, exclude=excluded, **route)
        return self._with_affinity(hops, candidates, excluded, load)

    def _with_affinity(self, hops: list[Hop], candidates, excluded: Mapping[str, str],
                       load: ShardLoad | None) -> list[Hop]:
        """`hops`, or the chain of ours that kept this call's leading blocks when that predicts the shorter call."""
        reusable = self._reusable(self.naming(hops[0].quantization) if hops else None)
        if reusable is None:
            return hops
        model = self.call.model
        # The shards routing itself may use (router.py `usable`): one advertising another layer count is neither a
        # hop of the kept chain nor a replica checking a hop.
        usable = {c.shard_id: c for c in self.ctx.router.usable(
            candidates, model.weights_sha256, exclude=excluded, now=self.ctx.router.now(), load=load,
            model_layers=model.head.info.num_layers)}
        # Ours first (no lag behind the log), the read model's when it knows of more blocks (another orchestrator's
        # calls, or ours before a restart).
        kept = longer_kept(self.ctx.kept_chains.holding(reusable.hashes), self.recorded_kept.get(hops[0].quantization))
        chosen, _ = prefer_kept(hops, kept, usable, load=load,
                                block_tokens=reusable.block_tokens, prompt_positions=len(self.call.known_ids),
                                max_tokens=self.call.request.most_tokens,
                                prefill_token_cost=self.ctx.settings.prefix_cache.prefill_token_cost,
                                mirrors_per_hop=MIRRORS_PER_LEVEL[self.call.request.params.verify])
        return chosen

    async def _recorded_kept(self, reusable_by_scheme: dict[str, PrefixBlocks]) -> dict[str, KeptChain]:
        """Per scheme the call may be served in (with the blocks its chain may begin from), the chain the read model
        says keeps the most of its leading blocks (asked only where our own memory does not hold them all)."""
        sessions = self.ctx.projector.session_factory
        names: dict[str, list[str]] = {}
        for scheme, reusable in reusable_by_scheme.items():
            ours = self.ctx.kept_chains.holding(reusable.hashes)
            if ours is None or ours.blocks < len(reusable.hashes):
                # As the log records them for our member: another's hops keep nothing ours may attach.
                names[scheme] = [published_mark(name, self._mark_keeper()) for name in reusable.hashes]
        if sessions is None or not names:
            return {}
        key = self._mark_keeper()
        keeper = key.public_key if key is not None else None

        def read() -> dict[str, KeptChain]:
            found: dict[str, KeptChain] = {}
            with sessions() as session:
                for scheme, scheme_names in names.items():
                    # Only records our member signed (what it signs with is what its marks are drawn over).
                    recorded = kept_chain_holding(session, scheme_names, now_s, keeper)
                    if recorded is not None:
                        found[scheme] = recorded
            return found

        now_s = self.ctx.router.now()
        return await asyncio.to_thread(read)

    async def _public_blocks(self) -> int:
        """Whole blocks of the call's prompt inside a public system prompt it begins with."""
        settings, call = self.ctx.settings.prefix_cache, self.call
        if not settings.enabled or not settings.public_system_prompts or not call.model.head.has_tokenizer:
            return 0
        model_id = call.model.model_id
        encoded = self.ctx.public_prompt_ids.get(model_id)
        if encoded is None:
            encoded = await asyncio.to_thread(_encode_system_prompts, call.model.head, settings.public_system_prompts)
            self.ctx.public_prompt_ids[model_id] = encoded
        return public_blocks_of(call.prompt_ids, encoded, settings.block_tokens)


def _encode_system_prompts(head, prompts: list[str]) -> list[list[int]]:
    """Each public system prompt alone through the model's chat template (none without a template)."""
    if not getattr(head.tokenizer, "chat_template", None):
        return []
    encoded = []
    for text in prompts:
        try:
            encoded.append(head.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False))
        except Exception as error:  # a template without a system role: that prompt is never shared
            log.warning("public system prompt not usable with this model's template: %s", error)
    return encoded
