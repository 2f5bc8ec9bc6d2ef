"""Which NATS connections say when they have reconnected, and whom they tell: a quiet reader of a stream waits for its
next message, or for the reconnect that means its consumer may be gone, instead of looking at the connection's
reconnect count every fraction of a second (services.broker.connection.connect_nats tells; events.ordered_reader
listens)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from nats.aio.client import Client as NatsClient

# Per connection that tells, the listeners to call once it has reconnected.
_listeners: weakref.WeakKeyDictionary[NatsClient, set[Callable[[], None]]] = weakref.WeakKeyDictionary()


def tells_reconnects(nc: NatsClient) -> None:
    """`nc` will call `told_reconnected` after each reconnect (its owner's reconnected callback does)."""
    _listeners.setdefault(nc, set())


def listen_for_reconnects(nc: NatsClient, listener: Callable[[], None]) -> bool:
    """Call `listener` after each reconnect of `nc`; False when `nc` does not tell (nothing is registered)."""
    listeners = _listeners.get(nc)
    if listeners is None:
        return False
    listeners.add(listener)
    return True


def stop_listening(nc: NatsClient, listener: Callable[[], None]) -> None:
    listeners = _listeners.get(nc)
    if listeners is not None:
        listeners.discard(listener)


def told_reconnected(nc: NatsClient) -> None:
    """Tell every listener of `nc` that it has reconnected (from the connection's reconnected callback)."""
    for listener in list(_listeners.get(nc, ())):
        listener()
