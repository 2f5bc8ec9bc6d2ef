"""An orchestrator's --local-model that must be fetched before it can answer (`store:NAME`, a hub id not in the local
hub cache): fetched whole in the background from the start, and at hand (listed by llm.models as runnable locally,
run as the local fallback) only once it has arrived.

Listed earlier, calls routed to it would wait minutes for gigabytes, or fail, before their first token. The fetchers
show their own progress (a bar on a terminal); a failure is one warning line, and the next call that would fall back
on the model starts the fetch again (the store or the hub may be back). A hub download runs on a daemon thread
(`on_daemon_thread`): a cancelled task cannot stop a blocking call, and an orchestrator whose start failed (or that
stopped) would otherwise wait for gigabytes before its process could end; one cut short resumes at the next fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from hearth.inference.errors import first_line

log = logging.getLogger(__name__)

T = TypeVar("T")


async def on_daemon_thread(function: Callable[..., T], *args, **kwargs) -> T:
    """`function(*args, **kwargs)` on a thread of its own that neither asyncio.run's end nor the interpreter's waits
    for (asyncio.to_thread's are joined at both); cancelling the wait leaves the call running, its result dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], object]) -> None:
        if not future.done():  # the waiter may have been cancelled
            outcome()

    def run() -> None:
        try:
            outcome = functools.partial(future.set_result, function(*args, **kwargs))
        except BaseException as error:  # handed to the waiter, whatever it is
            outcome = functools.partial(future.set_exception, error)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=f"hearth-daemon-{getattr(function, '__name__', 'call')}", daemon=True).start()
    return await future


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
