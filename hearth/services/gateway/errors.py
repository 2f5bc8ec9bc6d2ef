"""Errors of the HTTP gateway as OpenAI error objects: the HTTP status, `type` and `code` for each way a call can
fail, from a request the gateway refuses itself, from the error frame the mesh ended a call with, from a
withdrawal of tokens a stream already sent, or from a failure the gateway did not foresee (its broker connection
closed under it, a bug)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from nats.errors import (
    ConnectionClosedError, ConnectionDrainingError, ConnectionReconnectingError, OutboundBufferLimitError,
    StaleConnectionError,
)
from starlette.responses import JSONResponse

from hearth.protocol.chat import BadRequest
from hearth.protocol.chat_frames import ErrorFrame, PipelineAbortedFrame, TokensWithdrawnFrame
from hearth.protocol.discovery import ServedModel
from hearth.protocol.refusals import (
    ARRAY_TOO_LONG, CONTEXT_EXCEEDED, OVER_MAX_REQUEST_BYTES, STRING_TOO_LONG, RefusalReason,
)
from hearth.services.gateway.openai_answers import ErrorBody, ErrorDetail
from hearth.services.gateway.openai_parts import UnknownParameter
from hearth.services.gateway.retry_hints import spread

# Error codes of the mesh (ErrorCode in protocol.chat_frames) -> (HTTP status, OpenAI error type); the rest are 500.
_FRAME_STATUS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "unauthorized": (403, "permission_error"),
    "overloaded": (429, "rate_limit_error"),
    "shard_unavailable": (503, "service_unavailable_error"),
    "pipeline_stalled": (503, "service_unavailable_error"),
    "orchestrator_gone": (503, "service_unavailable_error"),
}
# A frame with no `refusal` nor `param` (from an orchestrator older than them) is told by its words instead: how an
# unknown model's refusal begins (hearth/services/orchestrator/call_serving.py), and how a refusal names its field
# ("field 'stop.0': ...", "fields 'messages' and 'max_tokens': ..."): OpenAI's `param`.
_UNKNOWN_MODEL_PREFIX = "field 'model':"
_REFUSED_FIELD = re.compile(r"fields? '([^'.]+)")
default_retry_after_s = 1.0
# Codes of a 5xx no retry can change (protocol.md: "do not retry; ask the operator"): answered with `x-should-retry:
# false`, which OpenAI's clients obey, as they would otherwise send the call again (twice, by default).
_NOT_RETRIED = frozenset({"experimental_disabled"})
# The gateway's NATS connection cannot carry a call now (closed, draining at shutdown, reconnecting): a 503.
_BROKER_DOWN = (ConnectionClosedError, ConnectionDrainingError, ConnectionReconnectingError, OutboundBufferLimitError,
                StaleConnectionError)


@dataclass
class GatewayError(Exception):
    """A call that ends in an HTTP error; `retry_after_s` sets Retry-After and retry-after-ms (429, 503: the call may
    be sent again), each answer's spread at random above it (retry_hints.spread)."""

    status: int
    code: str
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            # Spread per answer; in milliseconds too, which OpenAI's clients read before Retry-After (whole seconds
            # by HTTP's rule, rounded up).
            wait_s = spread(self.retry_after_s)
            headers["retry-after-ms"] = str(math.ceil(wait_s * 1000))
            headers["Retry-After"] = str(math.ceil(wait_s))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.code in _NOT_RETRIED:
            headers["x-should-retry"] = "false"
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, "bad_request", message, param=param)


def too_large(message: str, param: str | None = None) -> GatewayError:
    """A 413 (Payload Too Large): the request is over `[orchestrator] max_request_bytes`."""
    return GatewayError(413, "request_too_large", message, param=param)


# Why a request was refused (hearth/protocol/refusals.py) -> OpenAI's status and code for that reason, which
# clients act on (trim a conversation on `context_length_exceeded`, never retry a 413).
_REFUSAL_ANSWERS: dict[RefusalReason, Callable[[str, str | None], GatewayError]] = {
    "request_too_large": too_large,
    "context_exceeded": lambda message, param: GatewayError(400, "context_length_exceeded", message, param=param),
    "array_too_long": lambda message, param: GatewayError(400, "array_above_max_length", message, param=param),
    "string_too_long": lambda message, param: GatewayError(400, "string_above_max_length", message, param=param),
    "unknown_model": lambda message, param: GatewayError(404, "model_not_found", message, param=param),
}
# The words each reason is told by in a frame that does not name it (see _UNKNOWN_MODEL_PREFIX).
_WORDED_REASONS: tuple[tuple[str, RefusalReason], ...] = (
    (OVER_MAX_REQUEST_BYTES, "request_too_large"), (CONTEXT_EXCEEDED, "context_exceeded"),
    (ARRAY_TOO_LONG, "array_too_long"), (STRING_TOO_LONG, "string_too_long"),
)


def refused(message: str, param: str | None = None, reason: RefusalReason | None = None) -> GatewayError:
    """The answer to a refusal of the request, the gateway's own or the mesh's (its `bad_request` frame), so that
    both read alike: OpenAI's status and code for `reason`, else 400 `bad_request`; `param` is OpenAI's `param`."""
    return (_REFUSAL_ANSWERS[reason] if reason else bad_request)(message, param)


def refusal_of(error: BadRequest) -> GatewayError:
    """The answer to a request the gateway refused itself (`error`'s field and reason as it names them); a key
    OpenAI's API does not know has OpenAI's code for it."""
    if isinstance(error, UnknownParameter):
        return GatewayError(400, "unknown_parameter", str(error), param=error.param)
    return refused(str(error), error.param, error.reason)


def _worded_refusal(message: str) -> tuple[str | None, RefusalReason | None]:
    """The field and the reason of a refusal in an older orchestrator's frame, told by its words: the field it names
    first, and the reason of its first problem."""
    if message.startswith(_UNKNOWN_MODEL_PREFIX):
        return "model", "unknown_model"
    field = _REFUSED_FIELD.match(message)
    first_problem = message.split("; ", 1)[0]  # describe_validation_error's separator
    reason = next((reason for words, reason in _WORDED_REASONS if words in first_problem), None)
    return (field[1] if field else None), reason


def unknown_model(model: str) -> GatewayError:
    return GatewayError(404, "model_not_found", f"the model {model!r} does not exist on this mesh; GET /v1/models "
                                                "lists the ones it can serve", param="model")


def not_served_whole(model: ServedModel, retry_after_s: float) -> GatewayError:
    """503 `shard_unavailable` for a model the mesh knows but whose layers live shards do not all cover now: what a
    call for it is answered (a 404 would tell OpenAI's clients it does not exist)."""
    covered = ", ".join(f"{lo}-{hi}" for lo, hi in model.covered_layers) or "none"
    return unavailable("shard_unavailable", f"the model {model.id!r} exists on this mesh, but live shards do not "
                       f"cover all its {model.total_layers} layers now (covered: {covered})", retry_after_s)


def unauthenticated(message: str) -> GatewayError:
    return GatewayError(401, "invalid_api_key", message, type="authentication_error")


def overloaded(message: str, retry_after_s: float) -> GatewayError:
    return GatewayError(429, "overloaded", message, type="rate_limit_error", retry_after_s=retry_after_s)


def unavailable(code: str, message: str, retry_after_s: float) -> GatewayError:
    """A 503: the mesh cannot serve the call now; Retry-After says when to send it again."""
    return GatewayError(503, code, message, type="service_unavailable_error", retry_after_s=retry_after_s)


def gateway_stopping(retry_after_s: float) -> GatewayError:
    return unavailable("gateway_stopping", "this gateway is shutting down and ended the call: send it again (to "
                       "another gateway, or once this one is back)", retry_after_s)


def from_frame(frame: ErrorFrame | PipelineAbortedFrame,
               default_retry_after_s: float = default_retry_after_s) -> GatewayError:
    """The HTTP error for the frame a call ended with; a 429's or 503's Retry-After is the frame's `retry_after_s`
    (an orchestrator's admission queue names one) or `default_retry_after_s` ([gateway] retry_after_s)."""
    message = frame.message if isinstance(frame, ErrorFrame) else frame.reason
    if frame.code == "bad_request":
        if isinstance(frame, ErrorFrame) and (frame.refusal is not None or frame.param is not None):
            return refused(message, frame.param, frame.refusal)
        return refused(message, *_worded_refusal(message))
    status, error_type = _FRAME_STATUS.get(frame.code, (500, "server_error"))
    retry_after_s = (getattr(frame, "retry_after_s", None) or default_retry_after_s) if status in (429, 503) else None
    return GatewayError(status, frame.code, message, type=error_type, retry_after_s=retry_after_s)


def tokens_withdrawn(frame: TokensWithdrawnFrame, kept_characters: int) -> GatewayError:
    """What ends a stream whose chunks carried tokens that `frame` took back (only ever sent as an event: the
    status is long gone); `kept_characters`: how much of the streamed text stands."""
    return GatewayError(502, "tokens_withdrawn", f"a check refuted the output of shard {frame.shard_id} "
                        f"({frame.reason}): only the first {frame.kept_tokens} tokens ({kept_characters} "
                        "characters) of the streamed text stand, the text after them is withdrawn; send the "
                        "request again for a whole answer", type="server_error")


def unforeseen(error: Exception, retry_after_s: float = default_retry_after_s) -> GatewayError:
    """The OpenAI error for an exception no other answer covers: 503 `nats_disconnected` (with `retry_after_s`) when
    the broker connection cannot carry the call, else 500 `internal_error` (its message only names the exception's
    type: a message may quote the request)."""
    if isinstance(error, _BROKER_DOWN):
        return unavailable("nats_disconnected", "the gateway's connection to the mesh's broker is down "
                           f"({type(error).__name__}); try again", retry_after_s)
    return GatewayError(500, "internal_error", f"the gateway failed ({type(error).__name__}); its log says where",
                        type="server_error")
