"""The gateway's side of the mesh: one NATS connection, who may call (API keys), which models exist, how many calls are
open (in all and per member, and how long they take: what a 429's Retry-After follows) and which are ended when the
gateway stops (CallStops), and MeshCall, one `llm.chat.request` (its body within the orchestrator's
max_request_bytes) whose frames the HTTP side reads.

A call is signed for the member its API key belongs to (services.client.chat signs with that key), so the
orchestrator records that member as the caller. Frames the HTTP answer does not carry (pipeline, shard status,
failover, keepalive, queued, and types added later) are skipped: a failover is a pause in the text, nothing more;
so is anything on the inbox that is no frame at all (services.client.chat skips it). A tokens_withdrawn frame is
part of the answer: it takes back tokens the call already gave (docs/gateway.md, "Withdrawn tokens"). A choice
whose answer grows past what the request allows (services.client.answer_bound) ends the call with a 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from hearth.services.client.answer_bound import AnswerBound, AnswerTooLong, warn_answer_too_long
from hearth.services.client.chat import ModelsRefused, configured_waits, list_models, request_payload
from hearth.services.client.pinned import stream_chat_pinned_raw
from hearth.protocol.chat import ChatRequest
from hearth.protocol.discovery import ModelsReply
from hearth.protocol.chat_frames import (
    DoneFrame,
    ErrorFrame,
    PipelineAbortedFrame,
    TokenDeltaFrame,
    TokensWithdrawnFrame,
)
from hearth.protocol.subjects import MODELS_REQUEST_SUBJECT
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.errors import (
    GatewayError, from_frame, gateway_stopping, overloaded, too_large, unauthenticated, unavailable, unknown_model,
)
from hearth.services.gateway.conversations import ConversationPins
from hearth.services.gateway.keys import Caller, WatchedApiKeyring, bearer_token
from hearth.services.gateway.model_listing import ModelListing
from hearth.services.gateway.retry_hints import CallDurations

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a call's answer is made of; every other frame type is skipped.
AnswerFrame = TokenDeltaFrame | TokensWithdrawnFrame | DoneFrame | ErrorFrame | PipelineAbortedFrame
FINAL = (DoneFrame, ErrorFrame, PipelineAbortedFrame)


class ClientGone(Exception):
    """The HTTP client disconnected while its call was under way."""


class CallStops:
    """Ends the calls still open when the gateway stops (`stop()`, once `[gateway] shutdown_grace_s` has passed),
    each with an answer of its own: 503 `gateway_stopping` with Retry-After, or that error event mid-stream. uvicorn's
    own end of the grace would cancel them instead, which answers a plain-text 500 or cuts a stream short."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self.stopped = False
        self._timeouts: set[asyncio.Timeout] = set()

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[None]:
        """Runs its body unless the gateway stops first: GatewayError 503 `gateway_stopping` then (and at once,
        after a stop)."""
        if self.stopped:
            raise gateway_stopping(self.retry_after_s)
        # A timeout, expired by stop(): it cancels the body once, and tells that cancellation from any other.
        try:
            async with asyncio.timeout(None) as timeout:
                self._timeouts.add(timeout)
                try:
                    yield
                finally:
                    self._timeouts.discard(timeout)
        except TimeoutError:
            if not timeout.expired():
                raise
            raise gateway_stopping(self.retry_after_s) from None

    def stop(self) -> None:
        self.stopped = True
        now = asyncio.get_running_loop().time()
        for timeout in list(self._timeouts):
            timeout.reschedule(now)


class Gateway:
    """State shared by every HTTP call: the connection, the keyring (None on an open mesh), the model list."""

    def __init__(self, nc: NatsClient, settings: HearthSettings, keyring: WatchedApiKeyring | None) -> None:
        self.nc = nc
        self.settings = settings
        self.keyring = keyring
        self.open_calls = 0
        self.open_calls_by_member: Counter[str] = Counter()
        # When each open call took its place, and whose it is; how long recent calls held theirs.
        self._open_since: dict[object, tuple[str | None, float]] = {}
        self.call_durations = CallDurations(settings.gateway.retry_after_s)
        self.listing = ModelListing(settings.gateway.models_cache_s)
        self._known_models: set[str] = set()
        self.stops = CallStops(settings.gateway.retry_after_s)
        # Which orchestrator answered each recent conversation: its next turn goes there first.
        self.pins = ConversationPins(settings.gateway.remembered_conversations)

    def caller(self, authorization: str | None) -> Caller | None:
        """The member whose API key came with the call; None on an open mesh (no keys asked for)."""
        if self.keyring is None:
            return None
        api_key = bearer_token(authorization)
        if api_key is None:
            raise unauthenticated("no API key: send 'Authorization: Bearer KEY' (`hearth community api-key` "
                                  "makes one)")
        caller = self.keyring.caller_for(api_key)
        if caller is None:
            raise unauthenticated("the API key is not known to this gateway")
        return caller

    async def models(self) -> ModelsReply:
        """What `llm.models` answers now; 503 when no orchestrator answers."""
        timeout_s, retry_after_s = self.settings.gateway.models_timeout_s, self.settings.gateway.retry_after_s
        try:
            reply = await list_models(self.nc, timeout_s)
        except NoRespondersError:
            raise unavailable("orchestrator_gone", f"no orchestrator is listening on {MODELS_REQUEST_SUBJECT}",
                              retry_after_s) from None
        except (NatsTimeoutError, asyncio.TimeoutError):
            raise unavailable("orchestrator_gone", f"no orchestrator answered {MODELS_REQUEST_SUBJECT} within "
                              f"{timeout_s:g} s", retry_after_s) from None
        except ModelsRefused as refused:
            if refused.frame is not None:
                raise from_frame(refused.frame, self.settings.gateway.retry_after_s) from None
            raise GatewayError(502, "internal_error", str(refused), type="server_error") from None
        self._known_models = {model.id for model in reply.models}
        self.listing.remember(reply)
        return reply

    async def default_model(self) -> str | None:
        """The model a call that names none gets, from a recent `llm.models` answer (ModelListing): a busy
        orchestrator that does not answer in time fails no such call once the gateway has had one answer."""
        return (await self.listing.recent(self.models)).default_model

    async def check_model(self, model: str | None) -> None:
        """404 for a model no orchestrator knows of; asks `llm.models` only for a name not seen there before."""
        if model is None or model in self._known_models:
            return
        if model not in {served.id for served in (await self.models()).models}:
            raise unknown_model(model)

    @contextlib.contextmanager
    def open_call(self, caller: Caller | None):
        """Counts a call as open while inside; 429 when `[gateway] max_open_requests` are open already, or
        `max_open_requests_per_caller` of the member `caller` (all its API keys together; an open mesh has no
        members, so only the first limit applies there). The 429's Retry-After is when one of the calls holding
        the places is likely to end (retry_hints.CallDurations), so that a refused call is not sent back while
        they all still run."""
        settings = self.settings.gateway
        member = caller.name if caller is not None else None
        if self.open_calls >= settings.max_open_requests:
            raise overloaded(f"this gateway has {settings.max_open_requests} calls open ([gateway] "
                             "max_open_requests); try again", self._until_a_place_frees(None))
        if member is not None and self.open_calls_by_member[member] >= settings.max_open_requests_per_caller:
            raise overloaded(f"this API key's member has {settings.max_open_requests_per_caller} calls open "
                             "([gateway] max_open_requests_per_caller); try again when one ends",
                             self._until_a_place_frees(member))
        place, started = object(), time.monotonic()
        self.open_calls += 1
        self._open_since[place] = (member, started)
        if member is not None:
            self.open_calls_by_member[member] += 1
        try:
            yield
        finally:
            self.open_calls -= 1
            del self._open_since[place]
            self.call_durations.record(time.monotonic() - started)
            if member is not None:
                self.open_calls_by_member[member] -= 1
                if not self.open_calls_by_member[member]:
                    del self.open_calls_by_member[member]

    def _until_a_place_frees(self, member: str | None) -> float:
        """How long until one of the open calls of `member` (None: of all members) is likely to end."""
        now = time.monotonic()
        return self.call_durations.until_one_ends(now - started for owner, started in self._open_since.values()
                                                  if member is None or owner == member)

    def call(self, request: ChatRequest, caller: Caller | None) -> "MeshCall":
        """`request` as a call of `caller`, published when its frames are first read; 413 when the body it is
        published as is over `[orchestrator] max_request_bytes`, which the orchestrator would refuse. That body
        is not the client's: hearth's defaults and request id add to it, so one within the limit can grow past it."""
        payload = request_payload(request)
        limit = self.settings.orchestrator.max_request_bytes
        if len(payload) > limit:
            raise too_large(f"body: {len(payload)} bytes as sent on to the mesh (with hearth's defaults for the "
                              f"fields left out), over [orchestrator] max_request_bytes {limit}: shorten the request "
                              f"by {len(payload) - limit} bytes")
        return MeshCall(self, request, payload, caller)


class MeshCall:
    """One `llm.chat.request` under way; `next()` gives its answer frames one by one, the last one final."""

    # The orchestrator the call went to first (None: the queue group).
    asked_first: str | None = None

    def __init__(self, gateway: Gateway, request: ChatRequest, payload: bytes, caller: Caller | None) -> None:
        client = gateway.settings.client
        self.request = request
        self.started = time.perf_counter()
        self._pins, self._member = gateway.pins, caller.name if caller else None
        # Not wrapped as stream_chat wraps it: aclose() below closes this generator itself.
        pinned = self.asked_first = self._pins.pinned(self._member, request)
        self._frames = stream_chat_pinned_raw(gateway.nc, payload, orchestrator=pinned,
                                              signer=caller.key if caller else None,
                                              **configured_waits(client, gateway.settings.orchestrator))

    @functools.cached_property
    def _answer_bound(self) -> AnswerBound:
        return AnswerBound.of(self.request)

    async def next(self) -> AnswerFrame:
        """The next answer frame; GatewayError 502 once a choice's answer grows past what the request allows (the
        call's stream ends then: the client learns the text is broken, not just cut)."""
        async for frame in self._frames:
            if isinstance(frame, DoneFrame) and frame.orchestrator is not None:
                self._pins.remember(self._member, self.request, frame.orchestrator)
            if isinstance(frame, (TokenDeltaFrame, TokensWithdrawnFrame, *FINAL)):
                try:
                    self._answer_bound.take(frame)
                except AnswerTooLong as error:
                    warn_answer_too_long(error, self.request.request_id, self.asked_first)
                    raise GatewayError(502, "internal_error", str(error), type="server_error") from None
                return frame
        # stream_chat_raw always ends with a final frame (one of its own when the orchestrator sends none).
        raise GatewayError(500, "internal_error", "the call's frames ended without a final frame", type="server_error")

    async def first_answer(self) -> TokenDeltaFrame | DoneFrame | ErrorFrame | PipelineAbortedFrame:
        """The first token, or the final frame when none comes: until then no HTTP status is decided."""
        while True:
            frame = await self.next()
            # Before the first token there is nothing to take back.
            if not isinstance(frame, TokensWithdrawnFrame):
                return frame

    async def aclose(self) -> None:
        """Stop listening: the orchestrator's next frame finds no responder and ends the call at once."""
        await self._frames.aclose()


async def unless_disconnected(receive, work: Awaitable[T]) -> T:
    """Await `work` unless the HTTP client disconnects first (ASGI `http.disconnect` from `receive`, read after
    the request body): then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
