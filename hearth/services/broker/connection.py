"""Opens the NATS client connection every hearth process uses: a first connect bounded by [nats]
connect_timeout_s (or patient with wait_for_broker), then reconnects forever, logging state changes once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from nats import errors as nats_errors
from nats.aio.client import DEFAULT_FLUSH_TIMEOUT
from nats.aio.client import Client as NatsClient

from hearth.events.cancellation import keeping_cancellation
from hearth.events.reconnect_notices import tells_reconnects, told_reconnected
from hearth.services.common.config import DEFAULT_NATS_URL, NATS_URL_ENV, NatsSettings, default_nats_url
from hearth.services.common.identity import Identity, load_identity
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.common.nats_urls import server_urls
from hearth.services.broker.closed_for_good import end_reconnecting_after_close
from hearth.services.broker.tls import client_ssl_context

# The status of the answer the server sends in place of a reply when nothing subscribes to the subject.
NO_RESPONDERS_STATUS = "503"

__all__ = ["DEFAULT_NATS_URL", "NATS_URL_ENV", "BrokerConnectionClosed", "BrokerRefusedCredentials",
           "BrokerUnreachable", "close_quietly", "connect_nats", "default_nats_url", "drain_or_close", "flush_ordered",
           "keepalive_options", "key_refused_event", "until_stopped_or_closed"]
_nats_defaults = NatsSettings()

log = logging.getLogger(__name__)

# Payloads up to this size are buffered while disconnected, so a broker restart loses no publish.
pending_buffer_bytes = 64 * 1024 * 1024
# While nats-py still holds back commands sent before a flush_ordered (a busy or slow connection), it looks again
# this often.
flush_ordered_poll_interval_s = 0.001
# How long nats-py itself waits for a flush's PONG: far beyond any caller's wait and beyond the pings that reveal a
# dead link (a reconnect forgets the PING), so it never gives up on a PONG that may still come (flush_ordered).
pong_wait_cap_s = 600.0
# nats-py starts TLS on a connection opened in clear (the broker's INFO comes first), so asyncio's stream protocol
# answers an end of file as for plain TCP and asyncio logs, as each TLS connection ends, that the answer has no
# effect: a WARNING after every command on a TLS broker, about nothing wrong. Only that record is dropped.
_TLS_EOF_NOTICE = "returning true from eof_received() has no effect when using ssl"
logging.getLogger("asyncio").addFilter(lambda record: record.getMessage() != _TLS_EOF_NOTICE)

# Every flush under way, held until its PONG (or the cap) ends it: a caller that stops waiting leaves it running.
_unawaited_flushes: set[asyncio.Task] = set()
# Errors that announce a disconnect the disconnected callback reports anyway.
_DISCONNECTING_ERRORS = (nats_errors.UnexpectedEOF, nats_errors.StaleConnectionError)


class BrokerUnreachable(ConnectionError):
    """The first connect did not reach the broker within [nats] connect_timeout_s (wait_for_broker was off)."""

    def __init__(self, url: str, timeout_s: float, tls_failure: BaseException | None = None) -> None:
        # A broker reached whose TLS handshake failed is the commonest misconfiguration, and looks unreachable.
        cause = (f": its TLS handshake failed ({tls_failure}; see [nats] tls_ca_file, tls_cert_file, tls_key_file)"
                 if tls_failure is not None else "")
        super().__init__(f"cannot reach NATS at {url} within {timeout_s:g} s{cause}")
        self.url = url
        self.timeout_s = timeout_s
        self.tls_failure = tls_failure


class BrokerConnectionClosed(CommandRefused):
    """The connection was closed for good while serving (nats-py does not reconnect after some protocol errors,
    such as the broker's `maximum control line exceeded`): a process left on it would run unreachable."""

    def __init__(self, name: str, last_error: BaseException | None) -> None:
        cause = f": {last_error}" if last_error is not None else ""
        super().__init__(f"{name}: the NATS connection was closed for good{cause}; stopping")


# Set once each connection connect_nats made is closed (by us, or for good by nats-py).
_closed_events: "weakref.WeakKeyDictionary[NatsClient, asyncio.Event]" = weakref.WeakKeyDictionary()
# Who each connection logged in as: the chat client signs its calls with that member's key.
_identities: "weakref.WeakKeyDictionary[NatsClient, Identity]" = weakref.WeakKeyDictionary()


# The broker's last refusal on each connection (a publish or subscribe its permissions deny): nats-py tells it only
# to the error callback, and a JetStream request refused so shows as a bare timeout.
_refusals: "weakref.WeakKeyDictionary[NatsClient, str]" = weakref.WeakKeyDictionary()
# Set at each connection's first such refusal, so that a wait can end on it instead of on its timeout.
_refused_events: "weakref.WeakKeyDictionary[NatsClient, asyncio.Event]" = weakref.WeakKeyDictionary()


# Set while the broker refuses each connection's key at its reconnects (its member removed, or the key rotated), cleared
# once it reconnects: nothing sent on it meanwhile is taken, so no shutdown waits for it.
_key_refusals: "weakref.WeakKeyDictionary[NatsClient, asyncio.Event]" = weakref.WeakKeyDictionary()


def key_refused_event(nc: NatsClient) -> asyncio.Event | None:
    """Set while the broker refuses `nc`'s key (made by connect_nats) at its reconnects; None for another connection."""
    return _key_refusals.get(nc)


def broker_refusal(nc: NatsClient) -> str | None:
    """The last thing the broker refused `nc` (made by connect_nats) for its permissions, as nats-py words it."""
    return _refusals.get(nc)


def refused_event(nc: NatsClient) -> asyncio.Event | None:
    """Set once the broker refuses `nc` (made by connect_nats) something for its permissions; None for another."""
    return _refused_events.get(nc)


def connection_identity(nc: NatsClient) -> Identity | None:
    """The member `nc` logged in as (connect_nats), or None on an open broker."""
    return _identities.get(nc)


def credential_options(settings: NatsSettings, identity: Identity | None = None) -> dict:
    """nats-py connect() options for TLS (given a CA) and for logging in as the member whose key
    `settings.creds_file` holds (neither without); `identity`: that key, already loaded."""
    options: dict = {}
    context = client_ssl_context(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    if context is not None:
        options["tls"] = context
    if identity is None and settings.creds_file is not None:
        identity = load_identity(settings.creds_file, settings.roster_file)
    if identity is None:
        return options
    # Our own inbox prefix: the broker lets a member subscribe to `_INBOX.<name>.>` and nothing wider.
    return {**options, "nkeys_seed_str": identity.key.seed.decode(), "inbox_prefix": identity.inbox_prefix}


def keepalive_options(settings: NatsSettings) -> dict:
    """nats-py connect() options that make a client notice a dead link to its node ([nats] ping_interval_s,
    max_outstanding_pings) and reconnect, to another node of a cluster where there is one."""
    return {"ping_interval": settings.ping_interval_s, "max_outstanding_pings": settings.max_outstanding_pings}


class BrokerRefusedCredentials(BrokerUnreachable):
    """The broker answered, but refused the connection: no credentials, or a key it does not know."""

    def __init__(self, url: str, creds_file: object) -> None:
        ConnectionError.__init__(self, f"NATS at {url} refused the connection (authorization violation): "
                                 + (f"its configuration does not know the key in {creds_file}" if creds_file
                                    else "it needs credentials; give --creds FILE"))
        self.url = url
        self.timeout_s = 0.0
        self.tls_failure = None


async def connect_nats(
    url: str | None = None,
    *,
    name: str = "hearth",
    on_reconnected: Callable[[], Awaitable[None] | None] | None = None,
    settings: NatsSettings | None = None,
    wait_for_broker: bool | None = None,
) -> NatsClient:
    """Connect to `url` (else settings' url); BrokerUnreachable when the first connect takes longer than
    `settings.connect_timeout_s`, unless `wait_for_broker` (default: the settings') says to wait forever.

    nats-py makes the attempts (max_reconnect_attempts=-1, reconnect_time_wait, connect_timeout per
    attempt); this only bounds them in time. Once connected, a broker restart never ends the process:
    the client reconnects forever. A failed attempt or reconnect is logged once, not once per attempt;
    closing the connection ourselves logs nothing above DEBUG.
    """
    if settings is None:
        settings = _nats_defaults
    wait = settings.wait_for_broker if wait_for_broker is None else wait_for_broker
    target = url or settings.url
    try:
        servers = server_urls(target)
    except ValueError as error:  # not from --nats or the configuration, both checked: $HEARTH_NATS_URL, read here
        raise CommandRefused(str(error)) from None
    nc = NatsClient()
    tells_reconnects(nc)
    closed_event = _closed_events.setdefault(nc, asyncio.Event())
    _refused_events[nc] = asyncio.Event()
    key_refused = _key_refusals[nc] = asyncio.Event()
    state = {"connected": False, "told_waiting": False, "told_refused": False}
    tls_failures: list[ssl.SSLError] = []  # the first connect's failed TLS handshakes
    refused = asyncio.Event()  # the broker kept saying our credentials are not good: no point trying again
    loop = asyncio.get_running_loop()
    refusals_s: list[float] = []  # when the broker refused them (loop time)

    async def errored(error: Exception) -> None:
        if not state["connected"]:
            if isinstance(error, ssl.SSLError):
                tls_failures[:] = [error]
            if "authorization violation" in str(error).lower():
                # A broker that is reloading its configuration can refuse a key it knows before and after (of 400
                # connects made while 4 members were added: 3 with nats-server 2.15.1, 1 with 2.10.26): only a
                # refusal that lasts means the key is unknown.
                refusals_s.append(loop.time())
                if refusals_s[-1] - refusals_s[0] >= settings.refused_grace_s:
                    refused.set()
            elif wait and not state["told_waiting"]:
                state["told_waiting"] = True
                log.warning("%s: NATS at %s is not reachable yet (%s); waiting for it", name, target, error)
            else:
                log.debug("%s: connecting to NATS %s failed: %s", name, target, error)
        elif nc.is_connecting and "authorization violation" in str(error).lower():
            # A reconnect the broker refuses (nats-py is CONNECTING while it logs in): this member was removed, or
            # its key rotated. nats-py tries again every reconnect_wait_s for ever: say it once per outage.
            key_refused.set()
            if not state["told_refused"]:
                state["told_refused"] = True
                log.warning("%s: NATS at %s refuses this member's key now (removed from the community, or its key "
                            "rotated?); still trying to reconnect", name, target)
            log.debug("%s: reconnecting to NATS %s refused: %s", name, target, error)
        elif nc.is_reconnecting or nc.is_closed or isinstance(error, _DISCONNECTING_ERRORS):
            # The disconnected callback says it once; each failed reconnect attempt is no news.
            log.debug("%s: NATS error while reconnecting: %s", name, error)
        else:
            if "permissions violation" in str(error).lower():
                _refusals[nc] = str(error)
                _refused_events[nc].set()
            log.warning("%s: NATS error: %s", name, error)

    async def disconnected() -> None:
        if nc.is_closed:  # we closed (or drained) it ourselves
            log.debug("%s: closed the NATS connection to %s", name, target)
        else:
            log.warning("%s: disconnected from NATS %s; reconnecting", name, target)

    async def closed() -> None:
        closed_event.set()
        await end_reconnecting_after_close(nc, settings.close_timeout_s)

    async def reconnected() -> None:
        state["told_refused"] = False
        key_refused.clear()
        log.info("%s: reconnected to NATS %s", name, target)
        told_reconnected(nc)
        if on_reconnected is not None:
            result = on_reconnected()
            if result is not None:
                await result

    identity = load_identity(settings.creds_file, settings.roster_file) if settings.creds_file else None
    connecting = nc.connect(
        servers=servers,
        **credential_options(settings, identity),
        name=name,
        connect_timeout=settings.connect_timeout_s,
        reconnect_time_wait=settings.reconnect_wait_s,
        **keepalive_options(settings),
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        pending_size=pending_buffer_bytes,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        closed_cb=closed,
        error_cb=errored,
    )
    connect_task = asyncio.ensure_future(connecting)
    refusal_task = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait((connect_task, refusal_task), timeout=None if wait else settings.connect_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        if not connect_task.done():
            connect_task.cancel()
            await close_quietly(nc)
            if refusals_s:
                raise BrokerRefusedCredentials(target, settings.creds_file)
            raise BrokerUnreachable(target, settings.connect_timeout_s, tls_failures[-1] if tls_failures else None)
        connect_task.result()
    except BaseException:  # cancelled (a requested stop) or a refusal nats-py does not retry
        connect_task.cancel()
        await close_quietly(nc)
        raise
    finally:
        refusal_task.cancel()
    state["connected"] = True
    if identity is not None:
        _identities[nc] = identity
    if state["told_waiting"]:
        log.info("%s: connected to NATS %s", name, target)
    return nc


async def until_stopped_or_closed(nc: NatsClient, stop_event: asyncio.Event, name: str) -> None:
    """Wait for `stop_event`; BrokerConnectionClosed when `nc` (made by connect_nats) is closed for good first."""
    closed_event = _closed_events.get(nc)
    if closed_event is None:
        await stop_event.wait()
        return
    stop_task = asyncio.ensure_future(stop_event.wait())
    closed_task = asyncio.ensure_future(closed_event.wait())
    try:
        await asyncio.wait((stop_task, closed_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (stop_task, closed_task):
            task.cancel()
        await asyncio.gather(stop_task, closed_task, return_exceptions=True)
    if not stop_event.is_set():
        raise BrokerConnectionClosed(name, nc.last_error)


async def close_quietly(nc: NatsClient, timeout_s: float = _nats_defaults.close_timeout_s) -> None:
    """Close a client without waiting long or raising (its broker may be gone, its first connect given up)."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(timeout_s):
            await nc.close()


async def connected_keeping_cancellation(connecting: Awaitable[NatsClient], close_timeout_s: float) -> NatsClient:
    """The connection `connecting` (connect_nats) makes; CancelledError instead, that connection closed, when this
    task was cancelled meanwhile: nats-py's connect waits with asyncio.wait_for, which on Python 3.11 drops a
    cancellation landing in the turn it connects, and a caller raising it bare would leave the connection open."""
    return await keeping_cancellation(connecting, release=lambda nc: close_quietly(nc, close_timeout_s))


@contextlib.asynccontextmanager
async def steward_connection(nats: NatsSettings, system_key: Path) -> AsyncIterator[NatsClient]:
    """A connection to `nats.url` as the community's steward (`system_key`: the system member's key), closed on
    leaving; BrokerUnreachable when the broker cannot be reached."""
    settings = nats.model_copy(update={"creds_file": system_key})
    connection = await connect_nats(settings.url, name="hearth steward", settings=settings)
    try:
        yield connection
    finally:
        await close_quietly(connection, settings.close_timeout_s)


async def drain_or_close(nc: NatsClient, timeout_s: float) -> None:
    """At shutdown: drain the connection (nats-py flushes what we published, then closes) within `timeout_s`
    (`[nats] drain_timeout_s`), else just close it; never raises (the broker may be gone)."""
    if nc.is_closed:
        return
    try:
        # In this task, not wait_for's (3.11: it drops a cancellation landing as the drain ends); nats-py's drain
        # swallows a CancelledError, so keeping_cancellation tells the timeout's and a stop's apart from it.
        async with asyncio.timeout(timeout_s):
            await keeping_cancellation(nc.drain())
    except Exception as error:
        log.debug("draining the NATS connection failed (%s); closing it", error)
        await close_quietly(nc)


def _forget_flush(flush: asyncio.Task) -> None:
    _unawaited_flushes.discard(flush)
    if not flush.cancelled():
        flush.exception()  # retrieved: nobody may be waiting for it any more


async def flush_ordered(nc: NatsClient, timeout_s: float = DEFAULT_FLUSH_TIMEOUT) -> None:
    """Return once the server has processed every command this connection sent before the call: a subscription is
    in its interest graph, a publish was routed (or answered "no responders"); FlushTimeoutError after `timeout_s`.

    nats-py's flush() writes its PING to the socket at once, while commands sent just before it (SUB, PUB) may
    still wait in the client's queue for its flusher task: the PONG can then come back before the server has seen
    them, so a shard that had subscribed and flushed could still be answered "no responders" to a probe (most often
    when its SUB was queued behind a large publish). A PING written while that queue is empty follows them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await asyncio.sleep(0)  # the flusher's turn: it writes what is queued
        if nc.is_closed:
            raise nats_errors.ConnectionClosedError
        remaining_s = deadline - loop.time()
        if remaining_s <= 0:
            raise nats_errors.FlushTimeoutError
        if nc.pending_data_size == 0:
            # nats-py's flush cancels its PONG future on a timeout or a cancellation but leaves it queued: the PONG
            # that comes later fails the connection's read loop (InvalidStateError), and the connection hears
            # nothing until it reconnects. So its flush is left to run to its PONG, and only our wait is bounded.
            flush = asyncio.ensure_future(nc.flush(timeout=pong_wait_cap_s))
            _unawaited_flushes.add(flush)
            flush.add_done_callback(_forget_flush)
            done, _ = await asyncio.wait({flush}, timeout=remaining_s)
            if not done:
                raise nats_errors.FlushTimeoutError
            flush.result()
            return
        await asyncio.sleep(min(flush_ordered_poll_interval_s, remaining_s))


async def answers_ping(nc: NatsClient, timeout_s: float) -> bool:
    """Whether the broker answered a ping on `nc` (after everything sent before it) within `timeout_s`: False when our
    link is cut, which nats-py notices only once its own pings went unanswered (`[nats]` ping settings), or closed."""
    try:
        await flush_ordered(nc, timeout_s)
    except Exception:  # a flush timeout, a closed connection
        return False
    return True
