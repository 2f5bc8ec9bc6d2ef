"""ReceiverDrops: what an ActivationReceiver drops, and how it counts and logs each: frames refused before anything
is allocated for them, frames without the link's MAC, malformed frames, and unfinished steps abandoned for room."""

from __future__ import annotations

import logging

from hearth.services.common.metrics import counter
from hearth.services.transport.errors import TransportError
from hearth.services.transport.headers import FrameHeader
from hearth.services.transport.limits import StepRefusal

# The receiver's own logger: its drops are logged under the name they always were.
log = logging.getLogger("hearth.services.transport.receiver")

# A partial step's key: (session, step).
StepKey = tuple[str, int]

# The first refusal and every hundredth are warned about: a flood of forged frames must not flood the log.
refusal_log_every = 100

frames_refused_total = counter(
    "hearth_activation_frames_refused_total",
    "Activation frames refused before anything was allocated for them, because the step they declare does not "
    "fit the pipeline (`shape`, `positions`, `dtype`, `chunks`, `size`).",
    ["reason"],
)
for _reason in ("shape", "positions", "dtype", "chunks", "size", "mac"):  # read 0, not nothing, before any refusal
    frames_refused_total.labels(reason=_reason)


class ReceiverDrops:
    """Mixed into ActivationReceiver: reads its limits, partial steps, stats and refusal listener."""

    def _refusal(self, header: FrameHeader) -> StepRefusal | None:
        """Why the step this frame starts cannot be taken in (checked before anything is allocated for it)."""
        if self.step_limits is not None:
            refusal = self.step_limits.refusal(header)
            if refusal is not None:
                return refusal
        if header.total_bytes > self.max_step_bytes:
            return StepRefusal("size", f"step of {header.total_bytes} bytes exceeds max_step_bytes "
                                       f"{self.max_step_bytes}")
        return None

    async def _refuse(self, header: FrameHeader, refusal: StepRefusal) -> None:
        self.stats.refused_frames += 1
        frames_refused_total.labels(reason=refusal.reason).inc()
        refused = self.stats.refused_frames
        log.log(logging.WARNING if refused == 1 or refused % refusal_log_every == 0 else logging.DEBUG,
                "hop %s of pipeline %s: refusing step %s of session %s (%d refused so far): %s", self.hop,
                self.pipeline_id, header.step, header.session, refused, refusal.message)
        if self._on_refused is not None:
            await self._on_refused(header, refusal)

    def _make_room_for(self, step_bytes: int) -> None:
        """Abandon the oldest unfinished steps until this one's bytes fit the partial-step budget."""
        held = sum(partial.assembler.header.total_bytes for partial in self._partial.values())
        while self._partial and held + step_bytes > self.max_partial_bytes:
            oldest = next(iter(self._partial))
            held -= self._partial[oldest].assembler.header.total_bytes
            self._abandon(oldest, "unfinished steps would hold more than max_partial_bytes")

    def _abandon(self, key: StepKey, reason: str) -> None:
        if self._partial.pop(key, None) is not None:
            self.stats.dropped_steps += 1
            log.warning("hop %s of pipeline %s: abandoning step %s of session %s: %s",
                        self.hop, self.pipeline_id, key[1], key[0], reason)

    def _unauthenticated(self, *, unsealed: bool) -> None:
        """A frame without this link's MAC, or on a sealed link not sealed with its key: not ours to read, however
        well formed (forged, injected, or sent in clear). Counted under the reason `mac` either way, never logged."""
        self.stats.unauthenticated_frames += 1
        self.stats.unsealed_frames += unsealed
        frames_refused_total.labels(reason="mac").inc()
        dropped = self.stats.unauthenticated_frames
        log.log(logging.WARNING if dropped == 1 or dropped % refusal_log_every == 0 else logging.DEBUG,
                "hop %s of pipeline %s: dropping a frame %s (%d so far)", self.hop, self.pipeline_id,
                "not sealed on a sealed link" if unsealed else "without this link's MAC or seal", dropped)

    def _bad_frame(self, error: TransportError) -> None:
        self.stats.bad_frames += 1
        log.warning("hop %s of pipeline %s: dropping frame: %s", self.hop, self.pipeline_id, error)
