"""Waiting, at a process's start, until a projector has applied the event log as it stands, for the processes
that decide on their read model at once (the orchestrator's routing, `hearth host`'s placement)."""

from __future__ import annotations

import logging
import time

from hearth.readmodels.runner import Projector

log = logging.getLogger(__name__)


async def read_model_caught_up(projector: Projector, timeout_s: float, *, going_on: str) -> bool:
    """Wait (at most `timeout_s`) until `projector` has applied the event log as it stands; False when it could not
    tell or did not get there (logged, with what the caller does then: `going_on`). A process that decides on its read
    model at start waits so: one started with an empty read model would route on heartbeats minutes old and find no
    shard alive, or choose layers as if no host served any (the log's live adverts come last)."""
    started = time.monotonic()
    try:
        targets = await projector.wait_until_caught_up(timeout_s=timeout_s)
    except Exception as error:  # a timeout, or the broker could not say where the log ends
        log.warning("read model not caught up with the event log within %.0f s (%s); %s", timeout_s,
                    error or type(error).__name__, going_on)
        return False
    log.info("read model caught up with the event log (%s) in %.1f s",
             ", ".join(f"{stream} {seq}" for stream, seq in targets.items()), time.monotonic() - started)
    return True
