"""An orchestrator's --local-model that must be fetched before it can answer (`store:NAME`, a hub id not in the local
hub cache): fetched whole in the background from the start, and at hand (listed by llm.models as runnable locally,
run as the local fallback) only once it has arrived.

Listed earlier, calls routed to it would wait minutes for gigabytes, or fail, before their first token. The fetchers
show their own progress (a bar on a terminal); a failure is one warning line, and the next call that would fall back
on the model starts the fetch again (the store or the hub may be back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from hearth.inference.errors import first_line

log = logging.getLogger(__name__)


async def fetch_unless_at_hand(spec: str, resolve: Callable[[str], Path],
                               fetch: Callable[[], Awaitable[Path]]) -> LocalModelFetch | None:
    """A LocalModelFetch of `spec` by `fetch` unless `resolve` (blocking: run on a worker thread) finds it on this
    machine without the network, else None."""
    try:
        await asyncio.to_thread(resolve, spec)
        return None
    except LookupError:  # the catalog's UnknownModel
        return LocalModelFetch(spec, fetch)


class LocalModelFetch:
    """The whole model `spec` names, fetched by `fetch` (once at a time); `folder` once it has arrived."""

    def __init__(self, spec: str, fetch: Callable[[], Awaitable[Path]]) -> None:
        self.spec, self._fetch = spec, fetch
        self.folder: Path | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        """The fetch under way, started when none is (again after one that failed)."""
        if self._task is None or (self._task.done() and self.folder is None):
            self._task = asyncio.create_task(self._fetched(), name=f"fetch --local-model {self.spec}")
        return self._task

    async def folder_at_hand(self, *, wait: bool) -> Path | None:
        """The fetched folder; None while it is being fetched (`wait`: after the fetch ends) or when it failed."""
        if self.folder is None:
            fetching = self.start()
            if wait:
                await asyncio.shield(fetching)  # a waiter cancelled leaves the fetch going
        return self.folder

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _fetched(self) -> None:
        log.info("fetching --local-model %s (the whole model); it is listed once it has arrived", self.spec)
        try:
            self.folder = await self._fetch()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any failure of a background fetch: one line, never an unread task error
            log.warning("--local-model %s could not be fetched (%s): not run locally until a later try succeeds",
                        self.spec, first_line(error))
            return
        log.info("--local-model %s has arrived: listed as runnable locally", self.spec)
