"""Prometheus metrics of an orchestrator: how its calls end, how long construction, the first token and decoding
take, how long each hop holds a step as the orchestrator sees it and how long its own turn between two decode steps
takes, failovers, fallbacks and corruption, and how its calls' head steps are batched and how long they take (both
observed by hearth/services/orchestrator/head_batcher.py).

Most figures are taken from the audit events a PipelineRun records (`observe_event`, called by its `_record`), so
the metrics and the event log cannot disagree and the pipeline code needs no extra calls. The others are not
events: how a call ended for its client (`count_request`: "ok" or the error code of its final frame), each hop's
share of a step and the orchestrator's turn from a step's output to the next decode step (`HopLatencies`, read off
the acks and sends the chain sees anyway), and the head steps.

Label values are bounded: error codes and failure kinds are closed sets (initialised at import, so a rate over
them reads 0 rather than nothing), shard ids come from the mesh's advertisements. docs/metrics.md lists them all.
"""

from __future__ import annotations

import time
from typing import get_args

from hearth.events.models import (
    IntegrityCorruptionDetected,
    PipelineCompleted,
    PipelineConstructed,
    PipelineFailover,
    PipelineFallbackLocal,
    PipelineFirstToken,
)
from hearth.protocol.chat_frames import DoneFrame, ErrorCode, ErrorFrame, PipelineAbortedFrame
from hearth.services.common.metrics import counter, gauge, histogram, metrics_observed
from hearth.services.orchestrator.check_policy import CHECK_OUTCOMES, VERIFICATION_CHECKS_METRIC
from hearth.services.orchestrator.outcomes import FailureKind
from hearth.services.transport import FrameKind
from hearth.services.transport.notices import NOTICE_REFUSALS

# A call that ended without a final frame: its client went away, or the orchestrator stopped under it.
CLIENT_GONE = "client_gone"
ORCHESTRATOR_GONE = "orchestrator_gone"
OK = "ok"
integrity_checks = ("nan", "inf", "norm", "shape")
ORCHESTRATOR_TURN_METRIC = "hearth_orchestrator_turn_seconds"
HEAD_STEP_METRIC = "hearth_head_step_seconds"

construct_buckets_s = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
first_token_buckets_s = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
tokens_per_second_buckets = (0.5, 1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
hop_buckets_s = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0)

pipeline_construct_seconds = histogram(
    "hearth_pipeline_construct_seconds",
    "Routing and opening every hop of a call's pipeline (the first construction of each call).",
    buckets=construct_buckets_s)
first_token_seconds = histogram(
    "hearth_first_token_seconds", "From a call's arrival to its first sampled token.", buckets=first_token_buckets_s)
decode_tokens_per_second = histogram(
    "hearth_decode_tokens_per_second",
    "Decode speed of each completed call: tokens after the first, over the time since the first.",
    buckets=tokens_per_second_buckets)
orchestrator_turn_seconds = histogram(
    ORCHESTRATOR_TURN_METRIC,
    "The orchestrator's share of a decode token: from a step's output reaching it to the call's next decode step "
    "going out (the head step, sampling, streaming the token and sending the step included).", buckets=hop_buckets_s)
head_step_seconds = histogram(
    HEAD_STEP_METRIC, "A head step on the compute thread: final norm and lm_head, sampling, and the sampled tokens' "
    "embeddings (once per batch of calls' rows).", buckets=hop_buckets_s)
shard_latency_seconds = histogram(
    "hearth_shard_latency_seconds",
    "How long each hop held a step, as the orchestrator sees it: from the hop's first ack of the step to the next "
    "hop's (or, for the last hop, to the step's output reaching the orchestrator).",
    ["shard_id"], buckets=hop_buckets_s)
calls_refused_total = counter("hearth_calls_refused_total", "Calls refused by their signature check, by reason",
                              ["reason"])
calls_by_caller_total = counter("hearth_calls_total", "Signed calls accepted, by the calling member", ["caller"])
# foreign_reply: a request whose reply subject is not a caller's inbox; it gets no answer at all.
for _reason in ("unsigned", "malformed", "unknown_signer", "bad_signature", "stale", "replayed", "untrusted",
                "role_may_not_call", "foreign_reply"):
    calls_refused_total.labels(_reason)  # read 0, not nothing, before any refusal
failovers_total = counter(
    "hearth_failovers_total", "Pipelines repaired around a failed shard, by what went wrong with it.", ["reason"])
hop_notices_refused_total = counter(
    "hearth_hop_notices_refused_total",
    "Hop notices of this orchestrator's pipelines dropped unread: `malformed`, or `mac` (not sent by the hop it "
    "names: forged, or another hop speaking for it).", ["reason"])
fallback_to_local_total = counter(
    "hearth_fallback_to_local_total", "Calls finished on a whole local model because the mesh could not serve them.")
shard_corruption_detected_total = counter(
    "hearth_shard_corruption_detected_total",
    "Steps whose activations failed an integrity check, by the shard blamed and the check.", ["shard_id", "check"])
requests_total = counter(
    "hearth_requests_total", "Chat calls ended, by outcome: `ok`, or the code of the call's final error frame "
    "(`client_gone`, `orchestrator_gone`: ended without one).", ["code"])
# How an answer's warm-up ended (hearth/services/orchestrator/answer_kv.py).
WARM_UP_OUTCOMES = ("kept", "failed", "skipped")
answer_warm_ups_total = counter(
    "hearth_answer_warm_ups_total", "Answers of calls that ended well prefilled again on their hops so that those "
    "keep their blocks, by outcome: `kept`, `failed` (a hop refused or failed, or it timed out: only the prompt's "
    "blocks stay kept) or `skipped` (its hops at capacity or too many warm-ups under way; never retried).",
    ["outcome"])
head_batches_total = counter(
    "hearth_head_batches_total", "Head steps (final norm + lm_head, sampling) run as one batch for the calls whose "
    "tokens were due together (continuous batching; a batch of one row counts too).")
head_batch_rows_total = counter(
    "hearth_head_batch_rows_total", "Call head steps run in those batches (rows / batches: the mean batch size).")
verification_checks_total = counter(
    VERIFICATION_CHECKS_METRIC,
    "Checks of a hop's work on other replicas, by outcome: `confirmed` (per shard confirmed), `mismatch` (a shard "
    "proved wrong and quarantined), `disputed` (two replicas disagreed, nobody could say who was right), "
    "`no_replica` (fewer other replicas than its level asks could check it), `canary_confirmed` / "
    "`canary_mismatch` (a host answered a replayed canary right / wrongly), `history_forgotten` (a hop checked by "
    "fewer mirrors than its level asks: the chain's record forgot what a fresh replica would be fed in a lost "
    "mirror's place).", ["outcome"])
calls_in_flight = gauge("hearth_calls_in_flight", "Calls running through a pipeline now (queued ones excluded).")

for _outcome in CHECK_OUTCOMES:
    verification_checks_total.labels(_outcome)
for _reason in NOTICE_REFUSALS:
    hop_notices_refused_total.labels(_reason)
for _reason in get_args(FailureKind):
    failovers_total.labels(_reason)
for _outcome in WARM_UP_OUTCOMES:
    answer_warm_ups_total.labels(_outcome)
for _code in (OK, CLIENT_GONE, ORCHESTRATOR_GONE, *get_args(ErrorCode)):
    requests_total.labels(_code)


def observe_event(event) -> None:
    """Fold one audit event of a call into the metrics (PipelineRun records every event through here)."""
    if not metrics_observed():
        return
    if isinstance(event, PipelineConstructed):
        pipeline_construct_seconds.observe(event.construct_ms / 1000.0)
    elif isinstance(event, PipelineFirstToken):
        first_token_seconds.observe(event.ttft_ms / 1000.0)
    elif isinstance(event, PipelineCompleted):
        if event.completion_tokens > 1:
            decode_tokens_per_second.observe(event.tokens_per_second)
    elif isinstance(event, PipelineFailover):
        failovers_total.labels(event.reason).inc()
    elif isinstance(event, PipelineFallbackLocal):
        fallback_to_local_total.inc()
    elif isinstance(event, IntegrityCorruptionDetected):
        shard_corruption_detected_total.labels(event.shard_id, event.check).inc()


def final_frame_code(frame) -> str | None:
    """The outcome a frame ends a call with (`ok` or its error code); None for frames that end nothing."""
    if isinstance(frame, DoneFrame):
        return OK
    if isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
        return frame.code
    return None


def count_request(final_code: str | None, client_gone: bool) -> None:
    """Count one call served from arrival to its end; `final_code` as final_frame_code gave it (None: no final
    frame was sent)."""
    requests_total.labels(final_code or (CLIENT_GONE if client_gone else ORCHESTRATOR_GONE)).inc()


class HopLatencies:
    """Observes each hop's share of a step from the acks the chain's AckObserver collected for it, and the
    orchestrator's turn between a step's output and the next decode step."""

    def __init__(self, shard_ids: list[str]) -> None:
        self._children = [shard_latency_seconds.labels(shard_id) for shard_id in shard_ids]
        self._output_at: float | None = None
        for shard_id in shard_ids:  # rates over a chain's shards read 0, not nothing, before any corruption
            for check in integrity_checks:
                shard_corruption_detected_total.labels(shard_id, check)

    def output_reached(self, first_ack_at: dict[int, float] | None) -> None:
        """A step's output reached us now: the orchestrator's turn begins, and each hop's share of the step is
        observed (`first_ack_at`: hop -> monotonic time its first ack of the step was seen; None when unknown)."""
        self._output_at = time.monotonic()
        if first_ack_at is not None:
            self.observe(first_ack_at, self._output_at)

    def step_sent(self, kind: FrameKind) -> None:
        """A step went out: a decode step ends the turn the last output began (other kinds just forget it)."""
        if self._output_at is not None and kind is FrameKind.decode and metrics_observed():
            orchestrator_turn_seconds.observe(time.monotonic() - self._output_at)
        self._output_at = None

    def observe(self, first_ack_at: dict[int, float], output_at: float) -> None:
        """`first_ack_at`: hop -> monotonic time its first ack of the step was seen; `output_at`: when the step's
        output reached us. A hop whose own ack or whose successor's was not seen is skipped."""
        if not metrics_observed():
            return
        children = self._children
        last = len(children) - 1
        for hop, child in enumerate(children):
            started = first_ack_at.get(hop)
            ended = output_at if hop == last else first_ack_at.get(hop + 1)
            if started is not None and ended is not None and ended >= started:
                child.observe(ended - started)
