"""The gateway's HTTP server on uvicorn: its limits (connections, backlog, header size, keep-alive), a deadline
for receiving each request whole and one for a client that stops reading an answer, which uvicorn lacks.

uvicorn's keep-alive timeout covers only the idle time between requests and is reset by every byte received, so a
client that sends half a header line and stalls (or trickles a byte at a time) would hold its connection forever
without ever presenting an API key. uvicorn takes the HTTP protocol class as a setting (`http=`), so the deadline
is its h11 protocol with a timer added: armed when a connection opens and after each answer, disarmed once the
request (line, headers and body) is in. An ASGI middleware could not do it: the app runs only after the headers.
uvicorn has no write timeout either: a client that stops reading a streamed answer (its receive window full), or the
answers to requests it pipelined, would hold its connection (and a call's slot) as long as it likes, so the
transport's own flow control, pausing as soon as a byte waits, arms a second timer while it holds writing paused, and
drops the connection when the client has not read for that long. Paused is not unread: the kernel wakes a paused
writer only once much of its send buffer is free, so a client that reads slowly but steadily keeps writing paused for
long; when the timer ends, the bytes the client has not taken yet (ours and the kernel's unacknowledged ones) are
counted, and fewer than when it was armed means the client is still reading: the timer runs again.
At shutdown calls in flight have `[gateway] shutdown_grace_s` to finish; the gateway then ends those still open with
an answer of its own (503 `gateway_stopping`, or that error event mid-stream: services.gateway.mesh.CallStops), and
uvicorn cancels only what has not answered `stopped_calls_answer_s` later (its cancellation answers a plain-text 500,
or cuts a stream short). uvicorn's main loop wakes every 0.1 s to look for a stop and renew the Date header; the
gateway's waits for the stop and renews the header as requests come (an idle gateway is not woken ten times a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
import time
from collections.abc import Callable
from email.utils import formatdate

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hearth.services.common.config_sections import GatewaySettings
from hearth.services.common.metrics import counter

request_read_timeouts_total = counter(
    "hearth_gateway_request_read_timeouts_total",
    "Connections closed because they had not sent a whole request within [gateway] request_read_timeout_s")
write_stall_timeouts_total = counter(
    "hearth_gateway_write_stall_timeouts_total",
    "Connections dropped because their client read nothing of an answer for [gateway] write_stall_timeout_s")
_REQUEST_TIMEOUT_BODY = b"request read timeout"
# Written straight to the socket: h11 cannot send a response before a request head arrived.
_REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (len(_REQUEST_TIMEOUT_BODY), _REQUEST_TIMEOUT_BODY))
# How long after the grace the calls ended by the gateway have to answer before uvicorn cancels them.
stopped_calls_answer_s = 2.0
# The client's states in which its request is still arriving (h11: nothing yet, or its body).
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


class _Deadline:
    """One timer, armed at most once at a time: `passed` runs `timeout_s` after `arm()` unless `disarm()` came
    first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, passed) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._passed = passed
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._timeout_s, self._run)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _run(self) -> None:
        self._timer = None  # disarmed before `passed`, which may arm it again
        self._passed()


class DefaultHeaders:
    """The headers uvicorn adds to every answer (Date, and the configured ones), renewed when a request comes in a
    later second than the last: uvicorn renews them from the tick hearth's server does not run."""

    def __init__(self) -> None:
        self._second: int | None = None

    def renew(self, server_state, config: uvicorn.Config) -> None:
        second = int(time.time())
        if second != self._second:
            self._second = second
            date = [(b"date", formatdate(second, usegmt=True).encode())] if config.date_header else []
            server_state.default_headers = date + config.encoded_headers


class GatewayHttpServer(uvicorn.Server):
    """uvicorn's server as the gateway runs it: hearth's lifecycle owns SIGINT and SIGTERM (they set the process's
    stop), and the main loop waits for `should_exit` instead of looking every 0.1 s."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_requested = asyncio.Event()  # uvicorn's own __init__ sets should_exit
        super().__init__(config)

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        return self._exit_requested.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit_requested.set()
        else:
            self._exit_requested.clear()

    def capture_signals(self):
        return contextlib.nullcontext()

    async def main_loop(self) -> None:
        await self._exit_requested.wait()  # the process's stop (stop_serving), as long as it serves


class RequestDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with one deadline per request: a connection that has not sent a whole request within
    `read_timeout_s` of opening, or of its previous answer, is closed (answered 408 when it began a head it never
    finished)."""

    read_timeout_s: float  # set on the subclass request_deadline_protocol() makes
    write_stall_timeout_s: float
    default_headers: DefaultHeaders

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline = _Deadline(self.loop, self.read_timeout_s, self._read_deadline_passed)
        self._write_deadline = _Deadline(self.loop, self.write_stall_timeout_s, self._write_deadline_passed)
        # The bytes the client had not taken when writing paused, or at the stall deadline's last run.
        self._untaken_when_armed: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Writing pauses as soon as a byte waits for the client, so the stall deadline covers every unread answer,
        # a short one the connection is closing after included (close() waits for those bytes to drain).
        transport.set_write_buffer_limits(high=0)
        self._read_deadline.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._read_deadline.disarm()
        self._write_deadline.disarm()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._untaken_when_armed = self._bytes_not_taken()
        self._write_deadline.arm()

    def resume_writing(self) -> None:
        self._write_deadline.disarm()
        super().resume_writing()

    def _bytes_not_taken(self) -> int | None:
        """The answer bytes the client has not taken yet: those in our buffer and those the kernel holds
        unacknowledged (None: the platform cannot tell the kernel's). While writing is paused nothing is added, so
        fewer of them means the client read some."""
        unacknowledged = _unacknowledged_bytes(self.transport)
        return None if unacknowledged is None else self.transport.get_write_buffer_size() + unacknowledged

    def _write_deadline_passed(self) -> None:
        untaken = self._bytes_not_taken()
        if untaken is not None and self._untaken_when_armed is not None and untaken < self._untaken_when_armed:
            self._untaken_when_armed = untaken  # a slow reader, not a stalled one: it has another timeout to read
            self._write_deadline.arm()
            return
        write_stall_timeouts_total.inc()
        # abort, not close: close would wait for the unread bytes to drain, which is what the client withholds.
        self.transport.abort()

    def handle_events(self) -> None:
        self.default_headers.renew(self.server_state, self.config)  # before a request's answer takes them
        super().handle_events()
        if self.conn.their_state not in _RECEIVING:
            self._read_deadline.disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Answered early (a 401 before the body came) the deadline runs on; a new request gets a fresh one.
        if not self.transport.is_closing() and self.conn.their_state in _RECEIVING:
            self._read_deadline.arm()

    def _read_deadline_passed(self) -> None:
        if self.transport.is_closing():
            return
        request_read_timeouts_total.inc()
        head_begun, _ = self.conn.trailing_data  # bytes h11 holds of a head it has not parsed yet
        if self.conn.our_state is h11.IDLE and head_begun:
            self.transport.write(_REQUEST_TIMEOUT_RESPONSE)
        # With the head in, the app is waiting for the body: closing makes its `receive` say the client left.
        self.transport.close()


def _unacknowledged_bytes(transport: asyncio.Transport) -> int | None:
    """Bytes in the kernel's send queue of `transport`'s socket not acknowledged by the client yet (Linux's
    SIOCOUTQ, which is TIOCOUTQ); None where the platform cannot tell or the socket is gone."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return None
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return None


def request_deadline_protocol(read_timeout_s: float, write_stall_timeout_s: float) -> type[RequestDeadlineProtocol]:
    """The protocol class uvicorn gets as `http=`, with these deadlines."""
    return type("RequestDeadlineProtocol", (RequestDeadlineProtocol,),
                {"read_timeout_s": read_timeout_s, "write_stall_timeout_s": write_stall_timeout_s,
                 "default_headers": DefaultHeaders()})


def server_config(app, settings: GatewaySettings) -> uvicorn.Config:
    """uvicorn's configuration for the gateway's ASGI `app` under `settings` ([gateway])."""
    return uvicorn.Config(
        app, http=request_deadline_protocol(settings.request_read_timeout_s, settings.write_stall_timeout_s),
        ws="none", lifespan="off",
        access_log=False, log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_grace_s + stopped_calls_answer_s,
        timeout_keep_alive=settings.keep_alive_timeout_s, limit_concurrency=settings.max_connections,
        backlog=settings.listen_backlog, h11_max_incomplete_event_size=settings.max_header_bytes)


async def stop_serving(server: GatewayHttpServer, serving: asyncio.Task, grace_s: float,
                       end_open_calls: Callable[[], None]) -> None:
    """Stop `server` (`serving`: its serve() task): calls in flight have `grace_s` to finish, then `end_open_calls`
    ends the rest with answers of their own, which they have `stopped_calls_answer_s` to send."""
    server.should_exit = True
    await asyncio.wait((serving,), timeout=grace_s)
    end_open_calls()
    with contextlib.suppress(Exception, asyncio.CancelledError):  # serve()'s own end, its timeout's cancel included
        async with asyncio.timeout(stopped_calls_answer_s + 1.0):
            await serving
