"""Sends a conversation's next turn to the orchestrator that answered its previous turn (on that orchestrator's own
subject: only its member's hops may attach the history's kept KV, docs/design.md §13), and to the orchestrators'
queue group at once when that one cannot take it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client as NatsClient

from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import FINAL_FRAME_TYPES, ChatFrame, DoneFrame, TokenDeltaFrame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.services.client.chat import request_payload, stream_chat_raw
from hearth.services.common.config_sections import ClientSettings

_client_defaults = ClientSettings()

# Endings of a pinned call, before any token, after which the call goes to the queue group instead: nobody listens on
# the orchestrator's subject any more (or it went silent), or it has no room now. Any other ending is the answer.
FALLBACK_CODES = frozenset({"orchestrator_gone", "overloaded"})


def answered_by(frame: ChatFrame) -> str | None:
    """The orchestrator a call's final frame says answered it (a done frame's `orchestrator`), else None."""
    return frame.orchestrator if isinstance(frame, DoneFrame) else None


async def stream_chat_pinned_raw(nc: NatsClient, payload: bytes, *, orchestrator: str | None,
                                 **options) -> AsyncIterator[ChatFrame]:
    """stream_chat_raw's frames for `payload`, sent first to `orchestrator`'s own subject when given. When that call
    ends `orchestrator_gone` or `overloaded` before its first token, its final frame is not yielded and the call is
    sent again to the queue group (frames of the first try that came before, such as `queued`, were yielded: their
    `seq` starts again at 0 with the second). The pinned try waits for its first frame no longer than for any later
    one (`frame_gap_timeout`), since that orchestrator has the queue group to fall back on."""
    if orchestrator is not None:
        tokens = 0
        async with contextlib.aclosing(stream_chat_raw(nc, payload, subject=orchestrator_request_subject(orchestrator),
                                                       **_pinned_try(options))) as frames:
            async for frame in frames:
                tokens += isinstance(frame, TokenDeltaFrame)
                if not tokens and frame.type in FINAL_FRAME_TYPES and getattr(frame, "code", None) in FALLBACK_CODES:
                    break
                yield frame
            else:
                return
    async with contextlib.aclosing(stream_chat_raw(nc, payload, subject=CHAT_REQUEST_SUBJECT, **options)) as frames:
        async for frame in frames:
            yield frame


def _pinned_try(options: dict) -> dict:
    """`options` with the first-frame wait cut to the silence timeout. An orchestrator that took the call sends a
    frame or a keepalive within `[transport] keepalive_interval_s`, so a longer silence means nobody did; and a
    publish the broker drops (a broker whose permissions predate the orchestrators' own subjects) gets no "no
    responders": the full `first_frame_timeout` would hold up every such turn that long before the queue group."""
    first = options.get("first_frame_timeout", _client_defaults.first_frame_timeout_s)
    silence = options.get("frame_gap_timeout", _client_defaults.silence_timeout_s)
    return {**options, "first_frame_timeout": min(first, silence)}


async def stream_chat_pinned(nc: NatsClient, request: ChatRequest, *, orchestrator: str | None,
                             **options) -> AsyncIterator[ChatFrame]:
    """stream_chat_pinned_raw for `request`."""
    async with contextlib.aclosing(stream_chat_pinned_raw(nc, request_payload(request), orchestrator=orchestrator,
                                                          **options)) as frames:
        async for frame in frames:
            yield frame
