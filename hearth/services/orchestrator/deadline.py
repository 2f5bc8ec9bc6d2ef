"""A call's deadline, `[orchestrator] request_deadline_s`: a call still running when it passes is cancelled, its hops
are closed, its pipeline event says so, and its caller gets one `pipeline_aborted` frame naming the setting.

It ends `pipeline_stalled`, not `internal_error`: no bug ended it, time ran out before the answer was whole (as when
the broker stays away), so the caller retries the whole request and knows the text it received is incomplete."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar

from hearth.protocol.chat_frames import PipelineAbortedFrame
from hearth.services.orchestrator.recovery import PIPELINE_STALLED

# The deadline of the call the current task serves; a context variable because the call's parts (its runs, its
# choices' tasks) unwind a cancellation that does not say why it came.
_call_deadline: ContextVar[CallDeadline | None] = ContextVar("hearth_call_deadline", default=None)


class CallDeadline:
    """Holds one call to `deadline_s`: the body of `held()` is cancelled when it passes (TimeoutError leaves it), and
    `passed_deadline()` tells whatever unwinds inside it that this is why."""

    code = PIPELINE_STALLED

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._timeout: asyncio.Timeout | None = None

    @property
    def reason(self) -> str:
        return f"the call ran past [orchestrator] request_deadline_s ({self.deadline_s:g} s) and was cancelled"

    def passed(self) -> bool:
        return self._timeout is not None and self._timeout.expired()

    def frame(self) -> PipelineAbortedFrame:
        """What the caller is told."""
        return PipelineAbortedFrame(seq=0, code=self.code, reason=self.reason)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        token = _call_deadline.set(self)
        try:
            async with asyncio.timeout(self.deadline_s) as self._timeout:
                yield
        finally:
            _call_deadline.reset(token)


def passed_deadline() -> CallDeadline | None:
    """The deadline of the call this task serves, once it passed (None before, or outside any call)."""
    deadline = _call_deadline.get()
    return deadline if deadline is not None and deadline.passed() else None
