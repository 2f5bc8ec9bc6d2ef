"""The gateway's HTTP metrics: every request counted and timed to its last byte by route and status
(MetricsMiddleware), and the time to a streamed answer's first token."""

from __future__ import annotations

import time

from starlette.requests import ClientDisconnect

from hearth.services.common.metrics import counter, histogram

# nginx's "client closed request": the status counted for a call whose client left before the answer's last byte.
CLIENT_CLOSED_STATUS = 499
ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/healthz")
MODEL_ROUTE_PREFIX = "/v1/models/"
latency_buckets_s = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
requests_total = counter("hearth_gateway_requests_total", "HTTP requests answered, by route and status",
                         ["route", "status"])
request_seconds = histogram("hearth_gateway_request_seconds", "From request to the last byte of the answer "
                            "(a streamed one included), by route and status", ["route", "status"],
                            buckets=latency_buckets_s)
first_token_seconds = histogram("hearth_gateway_first_token_seconds", "From request to the first token leaving "
                                "the gateway, by route", ["route"], buckets=latency_buckets_s)


class MetricsMiddleware:
    """Counts every HTTP request and times it to its last byte, labelled by route and status: the status the answer
    started with, or CLIENT_CLOSED_STATUS when the client left (or was dropped for not reading) before its last byte,
    a stream cut short included (before, such a stream counted as the 200 it had started with)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else MODEL_ROUTE_PREFIX + "{model}" if path.startswith(MODEL_ROUTE_PREFIX) \
            else "other"
        status = 500
        answered = client_left = False  # answered: the answer's last byte was handed to the server

        async def receiving():
            nonlocal client_left
            message = await receive()
            client_left = client_left or message["type"] == "http.disconnect"
            return message

        async def sending(message) -> None:
            nonlocal status, answered, client_left
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            try:
                await send(message)
            except OSError:  # a server of ASGI spec 2.4 says so when the client is gone
                client_left = True
                raise

        started = time.perf_counter()
        try:
            await self.app(scope, receiving, sending)
        except ClientDisconnect:
            client_left = True
            raise
        finally:
            label = str(CLIENT_CLOSED_STATUS if client_left and not answered else status)
            requests_total.labels(route, label).inc()
            request_seconds.labels(route, label).observe(time.perf_counter() - started)
