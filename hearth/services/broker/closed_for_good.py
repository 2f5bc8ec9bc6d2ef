"""Ends the reconnect loop nats-py can leave running after a connection is closed, so a closed connection stays
closed: no more connects to the broker, no task left for a shutdown to wait on for ever.

nats-py's close cancels its reconnect task once. That task connects with asyncio.wait_for, which on Python 3.11
drops a cancellation landing in the turn its connect completes; the task then loops on (it never looks at the
closed status), sets the status back to reconnecting and tries again every `reconnect_wait_s` for ever.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NatsClient

log = logging.getLogger(__name__)

# How long one cancellation is given to end the task before it is cancelled again.
_cancel_again_after_s = 0.05


def _reconnecting_task(nc: NatsClient) -> asyncio.Task | None:
    # nats-py keeps no public handle on it; a nats-py without the attribute has nothing this can end.
    task = getattr(nc, "_reconnection_task", None)
    return task if isinstance(task, asyncio.Task) else None


async def end_reconnecting_after_close(nc: NatsClient, timeout_s: float) -> None:
    """Once `nc` is closed: cancel a reconnect task still running until it ends (for up to `timeout_s`), then close
    again what it opened meanwhile. Called from the connection's closed callback (every close and drain ends there)."""
    task = _reconnecting_task(nc)
    if task is None or task.done() or task is asyncio.current_task():
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait((task,), timeout=_cancel_again_after_s)
    if not task.done():
        log.warning("a closed NATS connection's reconnect task did not end within %g s", timeout_s)
        return
    if not nc.is_closed:  # the loop set the status back to reconnecting, and may hold a socket it opened
        await nc.close()
