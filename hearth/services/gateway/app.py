"""The gateway's ASGI app (Starlette): OpenAI's /v1/models (and /v1/models/{model}), /v1/chat/completions and
/v1/completions over the mesh's `llm.chat.request`, plus /healthz (its /metrics has a server of its own:
`hearth gateway --metrics-port`).

No HTTP status is sent before the call's first token or its final frame, so a call the mesh refuses or cannot
serve gets its own status (400, 404, 429, 503, ...) even when streamed; after the first token a streamed call
that fails ends with an OpenAI error event instead of `data: [DONE]`, and so does one whose chunks carried tokens
the mesh withdrew (a whole answer just leaves them out), and one cut by a failure the gateway did not foresee (its
broker connection closed): a stream never just stops, which a client would take for a whole answer. A client that
disconnects, while waiting or mid-stream, has its call's inbox closed at once, which ends the call on the
orchestrator and frees the hops. No CORS headers are sent unless `[gateway] cors_allowed_origins` names the web
origins that may call from a browser. How an answer leaves, whole or streamed, is answer_delivery.py; the HTTP
metrics and their middleware are http_metrics.py.
"""

from __future__ import annotations

import logging
import traceback
from contextlib import ExitStack

import anyio
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hearth.protocol.chat import BadRequest
from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame
from hearth.protocol.discovery import ServedModel
from hearth.services.client.chat import AnswerTokens
from hearth.services.gateway.answers import AnswerShape, ChatShape, CompletionShape
from hearth.services.gateway.answer_delivery import AnswerDelivery, SseResponse
from hearth.services.gateway.errors import (
    GatewayError, from_frame, not_served_whole, refusal_of, too_large, unforeseen, unknown_model,
)
from hearth.services.gateway.http_metrics import CLIENT_CLOSED_STATUS, MODEL_ROUTE_PREFIX, MetricsMiddleware
from hearth.services.gateway.mesh import ClientGone, Gateway, MeshCall, unless_disconnected
from hearth.services.gateway.openai_answers import ModelCard, ModelList
from hearth.services.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from hearth.services.gateway.openai_parts import unknown_parameter

log = logging.getLogger(__name__)
# What a browser page from an allowed origin may do ([gateway] cors_allowed_origins): the headers are those OpenAI's
# JavaScript SDK sends, which a preflight must allow or the browser sends nothing (the gateway reads only the first
# two). Named rather than "*", so that a header no client of ours sends stays refused.
CORS_METHODS = ("GET", "POST")
CORS_HEADERS = (
    "Authorization", "Content-Type",
    "OpenAI-Organization", "OpenAI-Project", "OpenAI-Beta",
    "X-Stainless-Lang", "X-Stainless-Package-Version", "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
    "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count", "X-Stainless-Timeout", "X-Stainless-Helper-Method",
    # Set by the SDK too; Firefox lets a page set it, so asks for it in the preflight.
    "User-Agent",
)
# Where OpenAI's API says a request's id, and its clients read it.
REQUEST_ID_HEADER = "x-request-id"


class Health(BaseModel):
    status: str
    nats_connected: bool
    open_calls: int


def _servable(model: ServedModel) -> bool:
    """Whether a call for `model` can be served now: live shards cover every layer, or an orchestrator runs it whole."""
    return model.complete or model.runnable_locally


def _card(model: ServedModel) -> ModelCard:
    return ModelCard(id=model.id, hearth_quantizations=model.quantizations if model.complete else [])


class GatewayApp(AnswerDelivery):
    """The routes' handlers over one Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def healthz(self, request: Request) -> Response:
        connected = self.gateway.nc.is_connected
        health = Health(status="ok" if connected else "nats_disconnected", nats_connected=connected,
                        open_calls=self.gateway.open_calls)
        return JSONResponse(health.model_dump(), status_code=200 if connected else 503)

    async def models(self, request: Request) -> Response:
        try:
            servable = await self._servable_models(request)
        except GatewayError as error:
            return error.response()
        return JSONResponse(ModelList(data=servable).model_dump())

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: one model of the list; 404 `model_not_found` for one the mesh does not know, 503
        `shard_unavailable` (a call's answer for it) for one it knows but cannot serve whole now."""
        model_id = request.path_params["model"]
        try:
            if not model_id:  # /v1/models/: no model named, so no such path
                raise GatewayError(404, "not_found", f"GET {request.url.path}: Not Found")
            model = next((model for model in await self._mesh_models(request) if model.id == model_id), None)
            if model is None:
                raise unknown_model(model_id)
            if not _servable(model):
                raise not_served_whole(model, self.gateway.settings.gateway.retry_after_s)
        except GatewayError as error:
            return error.response()
        return JSONResponse(_card(model).model_dump())

    async def _servable_models(self, request: Request) -> list[ModelCard]:
        """The models the mesh can serve now, asked for by the request's caller."""
        return [_card(model) for model in await self._mesh_models(request) if _servable(model)]

    async def _mesh_models(self, request: Request) -> list[ServedModel]:
        """Every model the mesh knows of (served whole now or not), asked for by the request's caller."""
        try:
            caller = self.gateway.caller(request.headers.get("authorization"))
            with self.gateway.open_call(caller):  # each asks the mesh: within the member's share of calls
                async with self.gateway.stops.watch():
                    reply = await self.gateway.models()
        except GatewayError:
            raise
        except Exception as error:
            raise self._unforeseen(request.url.path, error) from None
        return reply.models

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, ChatCompletionRequest, ChatShape, "chatcmpl-")

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, CompletionRequest, CompletionShape, "cmpl-")

    async def _answer(self, request: Request, body_model: type[ChatCompletionRequest | CompletionRequest],
                      shape_class: type[AnswerShape], id_prefix: str) -> Response:
        slot = ExitStack()
        call: MeshCall | None = None
        request_id: str | None = None  # the call's, once the body made one: every answer then names it
        try:
            caller = self.gateway.caller(request.headers.get("authorization"))
            # The slot before the body: a member's bodies are read and validated within its share of calls, so it
            # cannot keep the event loop busy with more of them at once. Asking the mesh about a model name it has
            # not seen counts as an open call too.
            slot.enter_context(self.gateway.open_call(caller))
            # A gateway that stops while the call is open answers it itself (CallStops), not uvicorn.
            async with self.gateway.stops.watch():
                body = await self._body(request, body_model)
                try:
                    chat_request = body.to_chat_request()
                except BadRequest as error:
                    raise refusal_of(error) from None
                request_id = chat_request.request_id
                # The size as published first: an oversized request naming an unknown model asks the mesh nothing.
                call = self.gateway.call(chat_request, caller)
                await self.gateway.check_model(chat_request.model)
                model = chat_request.model or await self.gateway.default_model() or "default"
                shape = shape_class(id=id_prefix + chat_request.request_id, model=model)
                if isinstance(shape, ChatShape):
                    shape.tools = body.may_call_tools
                first = await unless_disconnected(request.receive, call.first_answer())
                if not isinstance(first, (TokenDeltaFrame, DoneFrame)):
                    raise self._error(first)
                answers = [AnswerTokens(choice=choice) for choice in range(chat_request.n)]
                if body.stream:
                    events = self._events(request.url.path, call, shape, first, answers, body.include_usage)
                    stream = SseResponse(events, call, slot)
                    call, slot = None, ExitStack()  # the response owns them now
                    return _identified(stream, request_id)
                return _identified(await unless_disconnected(
                    request.receive, self._whole(call, shape, first, answers, chat_request.logprobs)), request_id)
        except GatewayError as error:
            if error.status >= 500 or error.status == 429:
                log.info("%s: %s", request.url.path, error)  # the code and message only: never the prompt
            return _identified(error.response(), request_id)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except Exception as error:
            return _identified(self._unforeseen(request.url.path, error).response(), request_id)
        finally:
            if call is not None:
                with anyio.CancelScope(shield=True):
                    await call.aclose()
            slot.close()

    def _error(self, frame) -> GatewayError:
        return from_frame(frame, self.gateway.settings.gateway.retry_after_s)

    def _unforeseen(self, route: str, error: Exception) -> GatewayError:
        return _unforeseen(route, error, self.gateway.settings.gateway.retry_after_s)

    async def _body(self, request: Request, body_model):
        limit = self.gateway.settings.orchestrator.max_request_bytes
        data = bytearray()  # a body trickled in small pieces would be copied again at each with bytes
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise too_large(f"body: over {limit} bytes ([orchestrator] max_request_bytes)")
        try:
            return body_model.model_validate_json(data)
        except ValidationError as error:
            raise refusal_of(unknown_parameter(error, data) or BadRequest.of_validation(error)) from None


def _identified(response: Response, request_id: str | None) -> Response:
    """`response` with the call's request id as `x-request-id`, where OpenAI's clients read a request's id (openai-
    python: `completion._request_id`, an error's `request_id`)."""
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


def _unforeseen(route: str, error: Exception, retry_after_s: float) -> GatewayError:
    """`error` as an OpenAI error (a 503's Retry-After `retry_after_s`), logged by its type and where it was raised:
    never its message, which may quote the request."""
    answer = unforeseen(error, retry_after_s)
    if answer.status >= 500 and answer.code == "internal_error":
        log.error("%s: %s raised at\n%s", route, type(error).__name__,
                  "".join(traceback.format_tb(error.__traceback__)).rstrip())
    else:
        log.info("%s: %s", route, answer)
    return answer


def create_app(gateway: Gateway) -> MetricsMiddleware:
    """The ASGI app for `gateway`, wrapped in its metrics."""
    handlers = GatewayApp(gateway)
    origins = gateway.settings.gateway.cors_allowed_origins
    middleware = [Middleware(CORSMiddleware, allow_origins=origins, allow_methods=CORS_METHODS,
                             allow_headers=CORS_HEADERS)] if origins else []
    app = Starlette(middleware=middleware, routes=[
        Route("/healthz", handlers.healthz, methods=["GET"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        # :path, as a model's id may hold a slash ("org/name"), which a client sends as it is or as %2F.
        Route(MODEL_ROUTE_PREFIX + "{model:path}", handlers.model, methods=["GET"]),
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
    ], exception_handlers={HTTPException: _openai_shaped})
    # A path with a trailing slash is not found, not redirected: a redirect's Location would be built from the
    # client's own Host header.
    app.router.redirect_slashes = False
    return MetricsMiddleware(app)


async def _openai_shaped(request: Request, error: HTTPException) -> Response:
    """Starlette's own refusals (no such path, a method the path does not take) in OpenAI's error shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_request")
    response = GatewayError(error.status_code, code, f"{request.method} {request.url.path}: {error.detail}").response()
    response.headers.update(error.headers or {})  # a 405's Allow
    return response
