"""The sections of hearth's configuration that the long-running mesh processes read for their own work:
`[orchestrator]` (how one orchestrator serves its calls), `[prefix_cache]` (reusing kept KV) and `[shard]` (how a
shard serves its hops: whether it may start, its memory and KV budget, eviction, its kernels, batching, announcing
itself). hearth/services/common/config.py composes them with the rest into HearthSettings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from hearth.events.envelope import max_event_duration_s
from hearth.events.streams import MiB
from hearth.protocol.bounds import max_retry_after_s
from hearth.services.common.config_sections import ConfigSection


# The choices of ShardSettings.cpu_linear_kernel (inference.cpu_kernels.CPU_LINEAR_KERNELS, which config cannot
# import without bringing torch).
CpuLinearKernel = Literal["torch", "onednn-batched", "onednn"]


class OrchestratorSettings(ConfigSection):
    """[orchestrator]: how one orchestrator serves its calls."""

    min_caller_trust: Literal["member", "trusted", "steward"] = Field(
        default="member", description="on a community mesh, the least trust a caller's signed call needs")

    request_deadline_s: float = Field(
        default=3600.0, gt=0,
        description="a call still running after this (queued, loading a head, generating) is cancelled, its hops "
                    "closed, and ends pipeline_stalled naming this setting (leaves room to load a head)")
    client_resubscribe_grace_s: float = Field(
        default=5.0, ge=0,
        description="after a reconnect, 'no responders' on a client inbox is not yet a leave, nor on the control "
                    "subject of a call's hop its host gone (the call then fails over around it)")
    client_missing_grace_s: float = Field(
        default=1.0, ge=0,
        description="'no responders' on a client inbox for this long (no reconnect of ours) is a leave: a client "
                    "whose broker node went away subscribes again on another one within it")
    catch_up_timeout_s: float = Field(
        default=2.0, gt=0, description="how long routing waits for its read model to reach the event log's end")
    silent_shard_recheck_s: float = Field(
        default=1.0, ge=0,
        description="when no shard is left to build a call's chain and some were only silent to its open (no "
                    "responders: also a live shard between two broker nodes), try those once more after this pause "
                    "before answering shard_unavailable")
    start_catch_up_timeout_s: float = Field(
        default=30.0, ge=0,
        description="at start, how long the orchestrator waits for its read model to reach the event log's end "
                    "before it answers calls (other orchestrators answer meanwhile; then it answers anyway), and a "
                    "`hearth host` before it chooses its layers")
    event_queue_max: int = Field(
        default=10000, ge=1, description="audit events waiting to be written; a full queue holds the call back")
    event_retry_wait_s: float = Field(
        default=1.0, gt=0, description="pause before writing an audit event again after a failed write")
    event_flush_timeout_s: float = Field(
        default=1.5, gt=0, description="at shutdown, how long the audit events still queued may take to write")
    event_publish_delay_s: float = Field(
        default=0.0, ge=0, description="testing only: every audit event write waits this long first")
    event_outbox_dir: Path | None = Field(
        default=None,
        description="where the orchestrator keeps each audit event until it is stored, to write it after a kill "
                    "(a SQLite file per process, locked; default $XDG_STATE_HOME/hearth/event-outbox, else "
                    "~/.local/state/hearth/event-outbox), and the member removals and key rotations it learned "
                    "(steward-keys.json), past the streams' retention")
    broker_wait_s: float = Field(
        default=30.0, gt=0,
        description="a call whose broker connection dropped waits this long for it (and its hops) to come back; a "
                    "gateway's call waits out its own connection's outages this long in all, then ends "
                    "pipeline_stalled")
    max_request_bytes: int = Field(
        default=1 * MiB, ge=1024,
        description="an `llm.chat.request` body larger than this is refused (`bad_request`) before it is parsed")
    max_request_header_bytes: int = Field(
        default=8 * 1024, ge=1024,
        description="an `llm.chat.request` or `llm.models` request whose NATS headers (names and values) are "
                    "larger than this is refused (`bad_request`) before any of them is read")
    max_broker_repairs: int = Field(
        default=3, ge=0, description="rebuilds of a call's pipeline after the broker connection was lost")
    max_queued_requests: int = Field(
        default=256, ge=0,
        description="calls waiting for room beyond those running; one more is answered `overloaded`")
    max_queued_per_caller: int = Field(
        default=32, ge=0,
        description="calls of one roster member waiting in the queue; one more is answered `overloaded` while "
                    "other members still get in (unsigned callers of an open mesh share the whole queue)")
    max_streams_per_caller: int = Field(
        default=4, ge=1,
        description="calls of one caller (a roster member; all unsigned callers together) running at once, and "
                    "for a member never every running place (at most max_concurrent_pipelines - 1); the rest "
                    "of its calls wait in the queue")
    overloaded_retry_after_s: float = Field(
        default=5.0, gt=0, le=max_retry_after_s,
        description="`retry_after_s` an `overloaded` answer suggests to its client")
    at_capacity_retry_s: float = Field(
        default=0.5, gt=0,
        description="a shard that answered `at_capacity` is tried again after this, or when one of our own "
                    "streams on it ends, whichever comes first")
    at_capacity_max_wait_s: float = Field(
        default=120.0, gt=0,
        description="a call that found no shard with room for this long is answered `overloaded`")
    prefill_chunk_tokens: int = Field(
        default=256, ge=0,
        description="a prompt is prefilled in steps of at most this many tokens, pipelined through the hops, so "
                    "other calls' tokens are computed between them; 0 prefills it in one step (a call that checks "
                    "its hops sends at most half of [verification] record_budget_mb in a step)")
    head_batch_sessions: int = Field(
        default=8, ge=1,
        description="the head steps (final norm + lm_head, sampling) of this many calls at most run as one batch "
                    "(1: none)")
    head_batch_window_ms: float = Field(
        default=2.0, ge=0,
        description="a head batch waits this long at most for the steps of other decoding calls (0: only what is "
                    "ready); a call decoding alone never waits")


class VerificationSettings(ConfigSection):
    """[verification]: how an orchestrator checks what shard hosts compute (docs/design.md, "Honest shards")."""

    sample_rate: float = Field(
        default=0.02, ge=0, le=1,
        description="in `sampled` calls, the chance that a step has each hop's work checked on another replica "
                    "(a check covers every position the hop ran since its last one)")
    guard_margin: float = Field(
        default=4.0, gt=1,
        description="an output whose per-position norm is beyond this factor of the range confirmed outputs "
                    "showed (either way) is checked at once")
    guard_min_positions: int = Field(
        default=16, ge=1,
        description="confirmed positions a layer range's guard needs before it judges; until then a chain's "
                    "first step is checked on every hop")
    settle_timeout_s: float = Field(
        default=30.0, gt=0,
        description="how long a call's last frame waits for the checks still running on its steps")
    kept_inputs_mb: float = Field(
        default=128, ge=0,
        description="what entered each hop over the positions its shards kept for later calls, held in memory so a "
                    "hop that begins from kept KV can still be checked (least recently used dropped beyond this, "
                    "a call's that alone exceeds it never kept, and any unused for [shard] prefix_cache_idle_s "
                    "dropped as the shards drop its blocks; such a hop is not checked then)")
    record_budget_mb: float = Field(
        default=128.0, gt=0,
        description="what a call's chain may hold in memory of its hops' inputs and outputs for checks; past half "
                    "of what its prompt leaves, the decoded steps every hop's checks have read are forgotten (a "
                    "`sampled` call checks its hops then); a prompt longer than it holds is checked as it streams, "
                    "each prefill chunk (at most half of it) waiting for the checks that make it room; once a call "
                    "needs room in it, each hop's checks feed one replica more than the level asks, from position "
                    "0, so that a mismatch past what it forgot still has a witness and a failed mirror a stand-in")
    canary_interval_s: float = Field(
        default=60.0, ge=0,
        description="about this often (jittered) one confirmed piece of work is replayed to a host of the same "
                    "layers that never saw it, and compared (0: never)")
    canaries_per_range: int = Field(
        default=4, ge=0, description="confirmed runs kept per layer range for replay (in memory only)")
    canary_max_positions: int = Field(
        default=256, ge=1, description="a kept run is cut to this many positions")
    canary_memory_mb: float = Field(
        default=128.0, gt=0,
        description="what the kept runs of every layer range together may hold in memory (random ones dropped "
                    "beyond it: shards may advertise many ranges)")


class PrefixCacheSettings(ConfigSection):
    """[prefix_cache]: how an orchestrator lets its calls reuse the KV its shards kept from earlier calls that began
    the same way (docs/design.md, "Kept prefixes"); the shards' side is `[shard] prefix_cache_idle_s`."""

    enabled: bool = Field(default=True, description="name the blocks of each call's tokens so shards keep and reuse "
                                                    "their KV (false: every call prefills everything)")
    block_tokens: int = Field(
        default=32, ge=1, le=4096,
        description="tokens per kept block: a call reuses the whole blocks it shares with an earlier one")
    public_system_prompts: list[str] = Field(
        default=[],
        description="system prompts whose blocks every caller may share (a community-wide prompt; on a community "
                    "mesh a shard keeps them per member whose orchestrators opened the hop); any other blocks are "
                    "kept per caller, so no member learns from timing what another one asked")
    prefill_token_cost: float = Field(
        default=0.25, gt=0,
        description="routing weighs a chain holding a call's prefix against the otherwise cheapest one by "
                    "predicted time: a prompt token costs this share of a decode step per token")
    warm_up_answers: bool = Field(
        default=True,
        description="once a call ended well and its answer was sent, its hops prefill the answer's whole blocks "
                    "again in the background and keep them, so a conversation's next turn prefills only its new "
                    "tokens (false: only the prompt's blocks are kept; a decode step's KV is never kept)")
    warm_up_timeout_s: float = Field(
        default=30, gt=0,
        description="an answer's warm-up that has not ended within this is abandoned (its blocks are not kept)")


class ShardSettings(ConfigSection):
    """[shard]: how a shard serves its hops: whether it may start, its memory and KV budget, eviction, its kernels,
    batching, and how it announces itself."""

    # The spec's default (false) stays; starting `hearth shard` by hand is consent, so only an explicit
    # `serve_shards = false` (file or env) makes it refuse (`serve_shards_refused`).
    serve_shards: bool = Field(default=False, description="set to false: `hearth shard` refuses to start here")
    eviction_idle_s: float = Field(
        default=600, gt=0,
        description="a session that has received no step for this long has its KV cache evicted (its hop stays "
                    "open; its next step is answered `session_evicted`)")
    max_memory_mb: float = Field(
        default=20000, gt=0, allow_inf_nan=False,
        description="a shard whose weights plus KV reserve need more than this on its device refuses to start")
    kv_cache_budget_mb: float = Field(
        default=1024, gt=0, allow_inf_nan=False,
        description="KV caches of one shard (and of an orchestrator's local model) together stay within this: a new "
                    "session that would exceed it evicts the least recently used idle one (its next step is "
                    "answered `session_evicted`). Left unset, a shard takes no more than max_concurrent_streams "
                    "sessions at its model's whole context need in its layers (a small range of a small model needs "
                    "far less than the default), and advertises what it took")
    prefix_cache_idle_s: float = Field(
        default=600, ge=0, le=max_event_duration_s,
        description="when a call ends well, its hops keep their KV for the whole blocks of its tokens (within "
                    "kv_cache_budget_mb, giving way first to live sessions) so that a call beginning the same way "
                    "prefills only the rest; kept blocks unused for this long are dropped (0: keep none), and an "
                    "orchestrator forgets what it keeps beside them after as long as its own setting says. A GPU's "
                    "static caches too: a kept prefix holds only its positions, and a new session's whole static "
                    "cache is made room for first")
    cuda_graph_max_tokens: int = Field(
        default=4096, ge=0,
        description="on a GPU, sessions get static KV caches of this many positions and decode steps replay CUDA "
                    "graphs (full-attention SDPA models; 0: dynamic caches, eager decode); a longer session fails, "
                    "and a shard serves at most the sessions whose static caches kv_cache_budget_mb holds")
    cpu_linear_kernel: CpuLinearKernel = Field(
        default="onednn-batched",
        description="float32 layers on the CPU: torch runs their projections as transformers builds them; "
                    "onednn-batched runs batched decode steps on oneDNN (faster) and one session's steps as torch "
                    "does (bitwise equal to generate()); onednn runs every step on oneDNN (faster alone too, not "
                    "bitwise equal; greedy tokens matched in every run measured; the source's BENCHMARKS.md, "
                    "\"oneDNN for batched steps\")")

    heartbeat_interval_s: float = Field(default=2.0, gt=0, description="between shard.heartbeat events")
    advertisement_ttl_s: float = Field(default=60.0, gt=0, le=max_event_duration_s,
                                       description="an advertisement expires after this")
    max_concurrent_streams: int = Field(default=4, ge=1, description="pipelines one shard serves at once")
    max_hops_per_opener: int = Field(
        default=0, ge=0, description="hops one orchestrator may hold on this shard at once, on a community mesh: the "
                                     "roster member whose key signed the `open` (one no member signed, or heard "
                                     "before, is refused unauthorized); further opens are refused at_capacity, so no "
                                     "member fills every stream with hops it keeps alive. 0: all but one of "
                                     "max_concurrent_streams (all of one). On an open mesh (no roster) opens are "
                                     "not told apart and only max_concurrent_streams applies")
    max_kv_share_per_opener: float = Field(
        default=0, ge=0, le=1, allow_inf_nan=False,
        description="the part of kv_cache_budget_mb that the sessions of one orchestrator's hops may reserve on this "
                    "shard, on a community mesh (as max_hops_per_opener): each hop reserves the KV cache its session "
                    "may reach (its open's max_session_tokens in the layers it runs; a static cache's whole size), and "
                    "an open (or a re-open) that would take its opener past its share is refused at_capacity, so no "
                    "member's sessions fill the cache and have every other member's evicted. 0: no share (a shard "
                    "over-commits its KV budget and evicts the least recently used idle session, whoever's, as a "
                    "mesh with one orchestrator member wants; set it where several members' orchestrators share the "
                    "shards, e.g. 0.75). On an open mesh opens are not told apart and only kv_cache_budget_mb "
                    "applies")
    hop_close_timeout_s: float = Field(
        default=5.0, gt=0, description="closing a hop waits this long for a step being computed to finish")
    withdraw_timeout_s: float = Field(default=2.0, gt=0, description="how long stopping waits to say it leaves")
    event_outbox_dir: Path | None = Field(
        default=None,
        description="where a shard host keeps each event it says once (its withdrawal) until it is stored, to write "
                    "it once the broker takes it, after a kill too (a SQLite file per process, locked; default "
                    "$XDG_STATE_HOME/hearth/shard-event-outbox, else ~/.local/state/hearth/shard-event-outbox), and "
                    "the member removals and key rotations it learned (steward-keys.json), past the shards stream's "
                    "retention")
    stop_drain_timeout_s: float = Field(
        default=10.0, ge=0, le=max_event_duration_s,
        description="stopped (SIGTERM, Ctrl-C), a shard (`hearth shard`, `hearth host`) withdraws at once (no new "
                    "call is routed to it) and waits this long at most for the calls going through it to end before "
                    "it closes what is left and exits (0: it closes them at once, and they fail over); a second "
                    "signal ends the wait")
    max_batch_sessions: int = Field(
        default=8, ge=1, description="steps of this many sessions at most run as one batched step: decode steps, "
                                      "and on a CPU prefills shorter than prefill_slice_min_tokens (1: none)")
    max_batch_tokens: int = Field(
        default=256, ge=1, description="a batched step brings at most this many tokens (its first row always): "
                                       "prefills of several prompts batch up to it, so the batches still flow "
                                       "through the hops pipelined rather than holding each hop in turn")
    batch_window_ms: float = Field(
        default=2.0, ge=0, description="a batch waits this long at most for the steps of other open hops (0: only "
                                       "what is ready); a shard serving one hop never waits")
    batch_merge_window_ms: float = Field(
        default=0.0, ge=0, description="a first hop's batch also waits this long at most for the steps of sessions "
                                       "due within it, so sessions decoding in groups a stage apart join into one "
                                       "batch: for shards sharing one machine's cores (hearth demo and bench set "
                                       "it); 0 (off) where each shard has its own machine")
    prefill_slice_layers: int = Field(
        default=1, ge=0, description="a long prefill step on a CPU runs this many layers per turn on the compute "
                                     "thread, so other sessions' steps run between its turns (0: every step "
                                     "whole; on a GPU steps always run whole)")
    prefill_slice_tokens: int = Field(
        default=64, ge=0, description="while other steps wait for the compute thread, a sliced prefill step's tokens "
                                      "go through its layers in pieces of this many, so that a turn is one layer of "
                                      "one piece (0: all its tokens at once; small pieces cost a CPU throughput)")
    prefill_slice_min_tokens: int = Field(
        default=256, ge=1, description="prefill steps of fewer tokens run whole, at the compute thread's priority "
                                       "(a short prompt is neither held up by the long prompts' slices nor starved by "
                                       "other sessions' decode steps; the default is the orchestrator's "
                                       "prefill_chunk_tokens, so a long prompt's chunks run in turns)")
    prefill_nice: int = Field(
        default=10, ge=0, le=19, description="steps run in turns run on a thread this many nice levels below the "
                                             "compute thread's CPU priority, so that on cores shared with other "
                                             "processes (other hops) short calls' steps go first (0: on the compute "
                                             "thread; a thread cannot raise its priority again once lowered)")


    @property
    def hops_per_opener(self) -> int:
        """The hops one opener may hold (max_hops_per_opener, its 0 resolved), never more than the shard serves."""
        share = self.max_hops_per_opener or max(1, self.max_concurrent_streams - 1)
        return min(share, self.max_concurrent_streams)

    def kv_share_bytes(self, budget_bytes: int) -> int | None:
        """The KV bytes one opener's hops may reserve of `budget_bytes` (max_kv_share_per_opener; None: no share)."""
        return int(self.max_kv_share_per_opener * budget_bytes) if self.max_kv_share_per_opener else None

    @property
    def kv_cache_budget_bytes(self) -> int:
        """kv_cache_budget_mb in bytes, as a runner takes it (inference.load_layer_range's cache_budget_bytes)."""
        return int(self.kv_cache_budget_mb * MiB)

    def shard_kv_budget_bytes(self, full_context_session_bytes: int | None) -> int:
        """The KV budget of a shard whose sessions each hold at most `full_context_session_bytes` in its layers (at
        the model's whole context; None: unknown): kv_cache_budget_mb where it was set (file or environment),
        else no more than max_concurrent_streams such sessions, which are all the caches it could ever hold for
        live sessions (kept prefixes give way to them): a larger default reserve only overstates its memory need
        (memory_required_mb, max_memory_mb's check) and its advertised budget."""
        if "kv_cache_budget_mb" in self.model_fields_set or full_context_session_bytes is None:
            return self.kv_cache_budget_bytes
        return min(self.kv_cache_budget_bytes, self.max_concurrent_streams * full_context_session_bytes)


def serve_shards_refused(shard: ShardSettings) -> bool:
    """True when this machine's configuration explicitly forbids serving shards."""
    return "serve_shards" in shard.model_fields_set and not shard.serve_shards
