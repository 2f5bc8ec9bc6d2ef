"""The gateway's request metrics count a call by what happened to it: a stream whose client left before its last byte
is a 499 ("client closed request", as nginx counts it), not the 200 it started with; a stream read to its end stays a
200 even when the client hangs up afterwards."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import StreamingResponse

from hearth.services.gateway.http_metrics import CLIENT_CLOSED_STATUS, MetricsMiddleware, requests_total

ROUTE = "/v1/chat/completions"
SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": ROUTE, "raw_path": ROUTE.encode(), "query_string": b"", "root_path": "",
         "headers": [], "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
wait_s = 5.0


def counted(status: int) -> float:
    return requests_total.labels(ROUTE, str(status))._value.get()


def stream_of(chunks: int | None):
    """An endpoint streaming `chunks` events (None: until it is cancelled)."""
    async def events():
        sent = 0
        while chunks is None or sent < chunks:
            yield b"data: {}\n\n"
            sent += 1
            await asyncio.sleep(0.01)

    return MetricsMiddleware(StreamingResponse(events(), media_type="text/event-stream"))


async def serve(app, *, leave_after_chunks: int) -> list[dict]:
    """Drive `app` as uvicorn does (ASGI spec 2.3): the request, then `http.disconnect` once the client has read
    `leave_after_chunks` body chunks, or after the whole answer."""
    sent: list[dict] = []
    left = asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if left.is_set():
            return  # uvicorn drops what is sent after the client left
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        finished = message["type"] == "http.response.body" and not message.get("more_body", False)
        if len(chunks) >= leave_after_chunks or finished:
            left.set()

    async with asyncio.timeout(wait_s):
        await app(dict(SCOPE), receive, send)
    return sent


def test_a_stream_whose_client_left_midway_counts_as_499_not_200():
    before_left, before_ok = counted(CLIENT_CLOSED_STATUS), counted(200)
    sent = asyncio.run(serve(stream_of(None), leave_after_chunks=2))
    assert sent[0]["status"] == 200  # the answer had started as a 200
    assert counted(CLIENT_CLOSED_STATUS) == before_left + 1 and counted(200) == before_ok


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_stream_read_to_its_end_counts_as_200(chunks):
    before_left, before_ok = counted(CLIENT_CLOSED_STATUS), counted(200)
    sent = asyncio.run(serve(stream_of(chunks), leave_after_chunks=chunks + 1))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert counted(200) == before_ok + 1 and counted(CLIENT_CLOSED_STATUS) == before_left
