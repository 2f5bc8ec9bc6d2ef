"""Cancels a projector's tasks and waits for them within a deadline, whatever a task does with its cancellation."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def cancel_within(tasks: list[asyncio.Task], timeout_s: float) -> None:
    """Cancel `tasks` and wait at most `timeout_s` for them to end. Not wait_for(gather(...)): on Python 3.11
    a task whose own wait_for swallowed the cancellation never ends, and wait_for would wait for it forever."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        log.warning("%d projector task(s) did not stop within %s s", len(pending), timeout_s)
