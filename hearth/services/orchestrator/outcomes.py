"""What can come of one step of a call (a sampled token, the call finished, or a failure) and why a chain could not
be had: the results the call's loop (hearth/services/orchestrator/pipeline.py) acts on and the recovery policy
(hearth/services/orchestrator/recovery.py) decides on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hearth.events.models import UNVERIFIED_REPORT
from hearth.services.transport.integrity import NormBounds, count_integrity_failure

# `reported`: a hop said its input failed a check. The orchestrator cannot verify that, so the hop accused is only
# routed around for this call: nobody is blamed in events or kept out of other calls' routing.
# `refuted`: a check on other replicas confirmed that the shard computed a step wrongly; `disputed`: one other replica
# disagreed with it and nobody could say who was right (routed around for this call, blamed nowhere).
FailureKind = Literal["stalled", "step_failed", "corrupt", "reported", "gone", "refused", "broker", "evicted",
                      "refuted", "disputed"]
# Failures the orchestrator did not see for itself: nobody is blamed in events or kept out of other calls' routing.
UNVERIFIED_KINDS = frozenset({UNVERIFIED_REPORT, "disputed"})
# Refusals that are no fault of the shard (protocol/control.py): another member opened the pipeline there first;
# the open's signature did not verify there (this orchestrator's key or clock, not the shard, is at fault); the shard
# had withdrawn (it is leaving) and this orchestrator's read model had not heard it yet.
UNBLAMED_REFUSALS = frozenset({"pipeline_taken", "unauthorized", "withdrawn"})


@dataclass(frozen=True)
class StepFailure:
    """Why a step (or an open) did not come through, and whom to route around: `shard_id` is None when the
    broker connection was lost and no shard is to blame."""

    kind: FailureKind
    shard_id: str | None
    reason: str
    check: str | None = None
    # The code of a shard's refusal to open (`at_capacity`, `weights_mismatch`, ...), when it refused.
    code: str | None = None
    # For `refuted` and `disputed`: the first position whose output is refuted; the tokens sampled from it on
    # are withdrawn before the call goes on.
    rewind_to: int | None = None

    @property
    def verified(self) -> bool:
        """Whether the orchestrator saw the failure itself (its own check, probe or refusal, or a hop's authenticated
        word about itself), so that it may blame the shard in events and keep it out of other calls for a while."""
        return self.kind not in UNVERIFIED_KINDS and self.code not in UNBLAMED_REFUSALS

    def __str__(self) -> str:
        return f"{self.shard_id}: {self.reason}" if self.shard_id else self.reason


@dataclass(frozen=True)
class RoutingFailure:
    """No chain could be opened for the call (the router's RoutingError code and message); `replacing`: the failure
    whose shard the chain was to replace (None for the call's first chain)."""

    code: str
    message: str
    replacing: StepFailure | None = None


@dataclass(frozen=True)
class SampledToken:
    """A token the call sampled from the output of its chain's last hop."""

    token_id: int
    # The text it released to the client (text held back for a possible stop string comes later).
    text: str
    # Why the call ends with this token (`stop`, `length`), None while it goes on.
    finish_reason: str | None
    # Whether the client is sent a delta for it: an end-of-sequence token that produced no text is not.
    shown: bool
    # The token's embedding: the input of the next decode step.
    embedding: torch.Tensor


@dataclass(frozen=True)
class Finished:
    """The call's last token was streamed: it ends with `reason`."""

    reason: str


def output_failure(output: torch.Tensor | None, step: int, sent_tokens: int, shard_ids: list[str],
                   bounds: NormBounds, resized_by: Callable[[int, int], int | None] | None) -> StepFailure | None:
    """Why the chain's output of `step` (`sent_tokens` positions sent) is not taken, or None: it must be a tensor of
    those positions that passes the sink's integrity check (`bounds`, per last hop). `resized_by`: which hop (an index
    into `shard_ids`) the taps saw change a step's positions (ChainRecorder.resized_by), when the chain records."""
    last_hop = shard_ids[-1]
    if output is None:  # a reset: no hop passes one on, so the last hop made it
        return StepFailure("corrupt", last_hop, f"its output of step {step} was a reset", check="shape")
    if output.shape[1] != sent_tokens:
        # Never taken: the checks of its work on other replicas could not compare outputs of two lengths, and a liar
        # evaded them. Hops pass a step on as they got it: the taps tell which one changed it, else nobody is blamed.
        reason = f"its output of step {step} has {output.shape[1]} positions, not the {sent_tokens} sent"
        culprit = resized_by(step, sent_tokens) if resized_by is not None else None
        if culprit is None:
            return StepFailure(UNVERIFIED_REPORT, last_hop, reason)
        return StepFailure("corrupt", shard_ids[culprit], f"{reason}: this hop changed them", check="shape")
    failed_check = bounds.check(output, last_hop)
    if failed_check is not None:
        count_integrity_failure(failed_check, "sink")
        return StepFailure("corrupt", last_hop, f"output failed the {failed_check} check", check=failed_check)
    return None


def retold_failure(shard_id: str, next_hop: int, position: int) -> StepFailure:
    """`shard_id` passed a step on to hop `next_hop` told otherwise (kind, position or prompt length) than it was
    sent, as the link's tap saw: what that hop computed from `position` on no replica told as sent would, so it is
    withdrawn and the hop before routed around for the call. Blamed nowhere: either end of a link holds its key."""
    return StepFailure(UNVERIFIED_REPORT, shard_id, f"it passed a step on to hop {next_hop} told otherwise than it "
                                                    f"was sent (as that link's tap saw): routed around, blamed nowhere",
                       rewind_to=position)


StepOutcome = SampledToken | Finished | StepFailure
# What the recovery policy decides on.
Failure = StepFailure | RoutingFailure
