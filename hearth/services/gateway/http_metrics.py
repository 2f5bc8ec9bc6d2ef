"""The gateway's HTTP metrics: every request counted and timed to its last byte by route and status
(MetricsMiddleware), and the time to a streamed answer's first token."""

from __future__ import annotations

import time

from hearth.services.common.metrics import counter, histogram

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
    """Counts every HTTP request and times it to its last byte, labelled by route and status."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else MODEL_ROUTE_PREFIX + "{model}" if path.startswith(MODEL_ROUTE_PREFIX) \
            else "other"
        status = [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, sending)
        finally:
            requests_total.labels(route, str(status[0])).inc()
            request_seconds.labels(route, str(status[0])).observe(time.perf_counter() - started)
