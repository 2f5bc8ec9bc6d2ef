"""A small async client for `llm.chat.request`: publish a request, iterate the frames from its inbox, and the
answer those frames make for each of the request's choices (token_delta frames, less those a tokens_withdrawn frame
took back; `chat` collects them within the request's bound, answer_bound.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from pydantic import ValidationError

from hearth.events.cancellation import keeping_cancellation
from hearth.services.client.answer_bound import within_bound
from hearth.services.common.call_signing import signed_call_headers
from hearth.services.common.config_processes import OrchestratorSettings
from hearth.services.common.config_sections import ClientSettings
from hearth.services.broker.connection import NO_RESPONDERS_STATUS, connection_identity
from hearth.protocol.chat import ChatRequest
from hearth.protocol.discovery import ModelsReply, ModelsRequest
from hearth.protocol.chat_frames import (
    FINAL_FRAME_TYPES,
    ChatFrame,
    DoneFrame,
    ErrorFrame,
    KeepaliveFrame,
    PipelineAbortedFrame,
    TokenDeltaFrame,
    TokensWithdrawnFrame,
    decode_frame,
)
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT
from hearth.trust.keys import MemberKey

log = logging.getLogger(__name__)
_client_defaults = ClientSettings()
_broker_wait_default_s = OrchestratorSettings().broker_wait_s
# Frames held after a gap before the call is given up (the orchestrator keeps about as many to send again).
max_held_frames = 1024


def _ending(code: str, message: str, after_seq: int) -> ErrorFrame:
    """An error frame this client makes up itself when the orchestrator cannot send one."""
    return ErrorFrame(seq=after_seq + 1, code=code, message=message)


async def stream_chat_raw(
    nc: NatsClient,
    payload: bytes,
    *,
    first_frame_timeout: float = _client_defaults.first_frame_timeout_s,
    frame_gap_timeout: float = _client_defaults.silence_timeout_s,
    broker_wait: float = _broker_wait_default_s,
    include_keepalives: bool = False,
    signer: MemberKey | None = None,
    subject: str = CHAT_REQUEST_SUBJECT,
) -> AsyncIterator[ChatFrame]:
    """Publish raw request bytes (valid or not) and yield frames until a final one; for tests and tools,
    and for the gateway, which checks the size of request_payload before it publishes it.

    The call is signed by `signer` when given (the gateway asks on behalf of the member an API key belongs to),
    else by the member the connection logged in as. It goes to `subject`: the orchestrators' queue group, or one
    orchestrator's own subject (hearth/services/client/pinned.py). A frame of a type this client does not know (one
    a newer orchestrator sends) is skipped; a numbered one still counts in the `seq` check. A message that is no
    frame at all (not a JSON object with a `type`, or a known type whose fields do not fit) is skipped too,
    uncounted.

    The orchestrator sends a frame or a keepalive at least every `[transport] keepalive_interval_s`, so a
    silence of `frame_gap_timeout` means it is gone: the stream then ends with an `orchestrator_gone` error
    frame of its own (as it does at once when no orchestrator listens at all). A silence while our own
    connection to the broker was down (or came back meanwhile) proves nothing and is waited out, for `broker_wait`
    seconds in all (`[orchestrator] broker_wait_s`, which an orchestrator waits for its own broker): then the stream
    ends with a `pipeline_stalled` error frame of its own, as the orchestrator's call would. Frames lost while a
    broker node was away (a gap in `seq`) are sent again by the orchestrator once this inbox is listened to again:
    frames after a gap are held until it is filled, and a frame seen before is skipped. A gap not filled within
    `frame_gap_timeout` ends the stream with `pipeline_stalled`: the text would be missing a piece.
    """
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    identity = connection_identity(nc)
    # On a community mesh every call is signed by a member (the orchestrator answers `unauthorized` otherwise);
    # the signature covers the inbox, so the answer cannot be redirected.
    key = signer or (identity.key if identity else None)
    headers = signed_call_headers(key, subject, inbox, payload) if key else None
    try:
        await nc.publish(subject, payload, reply=inbox, headers=headers)
        order = _FrameOrder(frame_gap_timeout)
        outage = _BrokerOutage(nc, broker_wait)
        timeout = first_frame_timeout
        while True:
            waited_from = time.monotonic()
            try:
                message = await keeping_cancellation(
                    subscription.next_msg(timeout=order.wait_s(outage.wait_s(timeout))))
            except (asyncio.TimeoutError, TimeoutError):
                if order.gap_overdue():
                    yield order.stalled()
                    return
                if outage.excuses(time.monotonic() - waited_from):
                    if outage.over():
                        yield outage.ending(order.last_seq)
                        return
                    continue
                yield _ending("orchestrator_gone", f"no frame and no keepalive from the orchestrator for "
                                                   f"{timeout} s", order.last_seq)
                return
            if message.headers and message.headers.get("Status") == NO_RESPONDERS_STATUS:
                yield _ending("orchestrator_gone", f"no orchestrator is listening on {subject}",
                              order.last_seq)
                return
            frame = _decode_known(message.data)
            if frame is None:
                log.debug("skipped a message on %s that is not a frame", inbox)
                continue
            timeout = frame_gap_timeout
            if isinstance(frame, KeepaliveFrame):
                if include_keepalives:
                    yield frame
            else:
                for ready in order.arrived(frame):
                    yield ready
                    if ready.type in FINAL_FRAME_TYPES:
                        return
            if order.gap_overdue() or order.too_many_held():
                yield order.stalled()
                return
    finally:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()


class _BrokerOutage:
    """The silences a call waited out because its own broker connection was down, or came back meanwhile (its
    frames may come again then), counted together up to `limit_s`."""

    def __init__(self, nc: NatsClient, limit_s: float) -> None:
        self.nc = nc
        self.limit_s = limit_s
        self.waited_s = 0.0
        self._reconnects = nc.stats["reconnects"]

    def wait_s(self, timeout_s: float) -> float:
        """How long to wait for the next message: `timeout_s`, or while the connection is down no longer than the
        outage may still last."""
        if self.nc.is_connected:
            return timeout_s
        return max(0.0, min(timeout_s, self.limit_s - self.waited_s))

    def excuses(self, silence_s: float) -> bool:
        """Whether a silence of `silence_s` is the outage's, not the orchestrator's (then it counts)."""
        reconnects = self.nc.stats["reconnects"]
        if self.nc.is_connected and reconnects == self._reconnects:
            return False
        self._reconnects = reconnects
        self.waited_s += silence_s
        return True

    def over(self) -> bool:
        return self.waited_s >= self.limit_s

    def ending(self, after_seq: int) -> ErrorFrame:
        return _ending("pipeline_stalled", f"this call waited {self.waited_s:.1f} s in all while its connection to "
                                           f"the NATS broker was down, over [orchestrator] broker_wait_s "
                                           f"{self.limit_s:g} s", after_seq)


class _FrameOrder:
    """Puts numbered frames in `seq` order: one already seen (sent again after a broker node went away) is skipped,
    and frames after a gap are held until the orchestrator sends the missing ones again; a gap still open after
    `gap_timeout_s` ends the call. A frame of a type this client does not know is an int (its seq) and only counts."""

    def __init__(self, gap_timeout_s: float) -> None:
        self.gap_timeout_s = gap_timeout_s
        self.last_seq = -1
        self._held: dict[int, ChatFrame | int] = {}
        self._gap_deadline: float | None = None

    def arrived(self, frame: ChatFrame | int) -> list[ChatFrame]:
        """The frames now in order, `frame` and any held ones it lets through."""
        seq = frame if isinstance(frame, int) else frame.seq
        if seq <= self.last_seq:
            return []
        if seq > self.last_seq + 1:
            self._held.setdefault(seq, frame)
            if self._gap_deadline is None:
                self._gap_deadline = time.monotonic() + self.gap_timeout_s
            return []
        ready = []
        while frame is not None:
            self.last_seq += 1
            if not isinstance(frame, int):
                ready.append(frame)
            frame = self._held.pop(self.last_seq + 1, None)
        self._gap_deadline = None if not self._held else time.monotonic() + self.gap_timeout_s
        return ready

    def wait_s(self, timeout_s: float) -> float:
        """How long to wait for the next message: `timeout_s`, or less while a gap is open."""
        if self._gap_deadline is None:
            return timeout_s
        return max(0.0, min(timeout_s, self._gap_deadline - time.monotonic()))

    def gap_overdue(self) -> bool:
        return self._gap_deadline is not None and time.monotonic() >= self._gap_deadline

    def too_many_held(self) -> bool:
        return len(self._held) > max_held_frames

    def stalled(self) -> ErrorFrame:
        missing = min(self._held) - 1 if self._held else self.last_seq + 1
        return _ending("pipeline_stalled", f"frames {self.last_seq + 1}-{missing} were lost while a connection to "
                                           f"the NATS broker was down, and not sent again", self.last_seq)


def _decode_known(data: bytes) -> ChatFrame | int | None:
    """The frame; the `seq` (-1 when it has none) of a JSON object whose `type` is not one of ours; None for a
    message that is no frame (not JSON, not an object, no `type`, or a known type whose fields do not fit)."""
    try:
        return decode_frame(data)
    except ValidationError as error:
        if not any(item["type"] == "union_tag_invalid" for item in error.errors(include_url=False)):
            return None
    seq = json.loads(data).get("seq")  # union_tag_invalid: a JSON object with a `type` we do not know
    return seq if type(seq) is int else -1


def request_payload(request: ChatRequest) -> bytes:
    """The body `llm.chat.request` carries for `request`: what the orchestrator's max_request_bytes bounds."""
    return request.model_dump_json(exclude_none=True).encode()


def configured_waits(client: ClientSettings, orchestrator: OrchestratorSettings) -> dict[str, float]:
    """stream_chat's waits as the configuration sets them ([client] first_frame_timeout_s and silence_timeout_s,
    [orchestrator] broker_wait_s): one reading for `hearth chat` and the gateway."""
    return {"first_frame_timeout": client.first_frame_timeout_s, "frame_gap_timeout": client.silence_timeout_s,
            "broker_wait": orchestrator.broker_wait_s}


async def stream_chat(nc: NatsClient, request: ChatRequest, *, signer: MemberKey | None = None,
                      subject: str = CHAT_REQUEST_SUBJECT, **timeouts: float) -> AsyncIterator[ChatFrame]:
    # aclosing: a caller that stops early unsubscribes the inbox now, not at garbage collection.
    async with contextlib.aclosing(stream_chat_raw(nc, request_payload(request), signer=signer, subject=subject,
                                                   **timeouts)) as frames:
        async for frame in frames:
            yield frame


def choice_of(frame: ChatFrame) -> int:
    """Which of the request's `n` choices `frame` is about (0 for frames that belong to the whole call)."""
    return getattr(frame, "choice", 0)


@dataclass
class AnswerTokens:
    """The token_delta frames one choice's answer is made of so far, as the call's frames arrive: each token_delta
    frame of `choice` adds its token; a tokens_withdrawn frame of `choice` keeps the first `kept_tokens` of the
    answer as it stands and drops the rest (a check refuted the step they came from); every other frame, and every
    frame of another choice, changes nothing."""

    frames: list[TokenDeltaFrame] = field(default_factory=list)
    choice: int = 0

    def take(self, frame: ChatFrame) -> list[TokenDeltaFrame]:
        """Apply `frame`; the token frames it withdrew (none for any other frame)."""
        if choice_of(frame) != self.choice:
            return []
        if isinstance(frame, TokenDeltaFrame):
            self.frames.append(frame)
        elif isinstance(frame, TokensWithdrawnFrame):
            withdrawn = self.frames[frame.kept_tokens:]
            del self.frames[frame.kept_tokens:]
            return withdrawn
        return []

    @property
    def text(self) -> str:
        return "".join(frame.text for frame in self.frames)

    @property
    def token_ids(self) -> list[int]:
        return [frame.token_id for frame in self.frames]


def answer_tokens(frames: Iterable[ChatFrame], choice: int = 0) -> AnswerTokens:
    """The answer `frames` make for `choice`, withdrawals applied."""
    answer = AnswerTokens(choice=choice)
    for frame in frames:
        answer.take(frame)
    return answer


def choice_count(frames: Sequence[ChatFrame]) -> int:
    """How many choices `frames` answer: those the done frame lists, else every choice a frame names (at least 1)."""
    final = frames[-1] if frames else None
    if isinstance(final, DoneFrame) and final.choices:
        return len(final.choices)
    return 1 + max((choice_of(frame) for frame in frames), default=0)


@dataclass
class ChatResult:
    """Everything one call streamed, collected; `text` and `token_ids` are the answer's (the first choice's when
    the request asked for `n` > 1), with the tokens that tokens_withdrawn frames took back left out (`frames` still
    holds every frame as sent)."""

    frames: list[ChatFrame] = field(default_factory=list)

    @property
    def text(self) -> str:
        return answer_tokens(self.frames).text

    @property
    def token_ids(self) -> list[int]:
        return answer_tokens(self.frames).token_ids

    def choice_texts(self) -> list[str]:
        """Every choice's text, in choice order."""
        return [answer_tokens(self.frames, choice).text for choice in range(choice_count(self.frames))]

    def choice_token_ids(self) -> list[list[int]]:
        """Every choice's token ids, in choice order."""
        return [answer_tokens(self.frames, choice).token_ids for choice in range(choice_count(self.frames))]

    @property
    def withdrawals(self) -> list[TokensWithdrawnFrame]:
        return [frame for frame in self.frames if isinstance(frame, TokensWithdrawnFrame)]

    @property
    def final(self) -> ChatFrame | None:
        return self.frames[-1] if self.frames else None

    @property
    def ok(self) -> bool:
        return isinstance(self.final, DoneFrame)

    def frames_of(self, frame_type: str) -> list[ChatFrame]:
        return [f for f in self.frames if f.type == frame_type]

    @property
    def error(self) -> ErrorFrame | PipelineAbortedFrame | None:
        final = self.final
        return final if isinstance(final, (ErrorFrame, PipelineAbortedFrame)) else None


async def chat(nc: NatsClient, request: ChatRequest, **timeouts: float) -> ChatResult:
    """Every frame of `request`'s call; one that takes a choice's answer past the request's bound (AnswerBound) ends
    it, as an `internal_error` frame of this client's own."""
    result = ChatResult()
    async for frame in within_bound(stream_chat(nc, request, **timeouts), request):
        result.frames.append(frame)
    return result


class ModelsRefused(Exception):
    """An orchestrator answered `llm.models` with an error frame (`frame`), or with what is no models reply (None)."""

    def __init__(self, frame: ErrorFrame | None) -> None:
        self.frame = frame
        super().__init__(f"{frame.code}: {frame.message}" if frame is not None
                         else f"the answer on {MODELS_REQUEST_SUBJECT} is no models reply")


async def list_models(nc: NatsClient, timeout_s: float = _client_defaults.first_frame_timeout_s) -> ModelsReply:
    """Ask `llm.models` which models the mesh can serve now. Raises nats' NoRespondersError when no orchestrator
    listens, its TimeoutError when none answers within `timeout_s`, and ModelsRefused for an answer that is no
    models reply."""
    message = await nc.request(MODELS_REQUEST_SUBJECT, ModelsRequest().model_dump_json().encode(), timeout=timeout_s)
    try:
        return ModelsReply.model_validate_json(message.data)
    except ValidationError:
        try:
            frame = ErrorFrame.model_validate_json(message.data)
        except ValidationError:
            raise ModelsRefused(None) from None
        raise ModelsRefused(frame) from None
