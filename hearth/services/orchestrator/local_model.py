"""The model an orchestrator may run whole (its --local-model, the local fallback): where it is on this machine and the
id llm.models lists it under, its background fetch when it must be fetched first (local_fetch.py), and the model
itself, loaded on first use (with its weights' digest, in a task of its own: a call cancelled meanwhile leaves the load
to the next call, and a model is never held without its digest).

It is found, fetched and named through its catalog (hearth/services/orchestrator/catalog.py): the catalog's `resolve`
(blocking, never the network), `folder` (fetching what must be) and `advertised_id`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from hearth.inference import LocalModel, load_full, weights_sha256
from hearth.inference.checkpoint import default_model_id
from hearth.inference.compute_thread import on_compute_thread
from hearth.inference.partial_checkpoint import NeededTensors
from hearth.services.common.config_processes import ShardSettings
from hearth.services.orchestrator.local_fetch import LocalModelFetch, fetch_unless_at_hand
from hearth.services.weights_store import STORE_MODEL_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModelAtHand:
    """The local model as this machine holds it now: the id shards loading it would advertise, and its folder (or
    GGUF file)."""

    model_id: str
    path: Path


class LocalModelHolder:
    """The local model `spec`: found (`at_hand`), fetched first when `spec` is a `store:NAME` model or, with
    `hub_id`, a hub id not in the local hub cache, and loaded once (`model`) for every call that falls back on it."""

    def __init__(self, spec: str, *, resolve: Callable[[str], Path],
                 folder: Callable[[str, NeededTensors], Awaitable[Path]],
                 advertised_id: Callable[[str, Path], str | None], hub_id: bool,
                 shard_settings: ShardSettings) -> None:
        self.spec, self._hub_id = spec, hub_id
        self._resolve, self._folder, self._advertised_id = resolve, folder, advertised_id
        self.fetch = LocalModelFetch(spec, self._fetch_whole) if spec.startswith(STORE_MODEL_PREFIX) else None
        # Its KV caches are bounded like a shard's on this machine ([shard] kv_cache_budget_mb and eviction_idle_s).
        self._kv_limits = {"cache_budget_bytes": shard_settings.kv_cache_budget_bytes,
                           "session_ttl_s": shard_settings.eviction_idle_s}
        self._model: LocalModel | None = None
        self.weights_sha256: str | None = None
        self._lock = asyncio.Lock()
        # The load under way: a task of its own, so that a call cancelled while it runs (its client left) neither
        # wastes it nor leaves the model held without its digest; the next call awaits the same load.
        self._loading: asyncio.Task | None = None
        self._closed = False

    def _fetch_whole(self) -> Awaitable[Path]:
        return self._folder(self.spec, None)

    def at_hand(self) -> LocalModelAtHand | None:
        """Where the model is now and its id, from one resolution of `spec` (blocking: it may read config and headers
        from disk); None when it is not found, or while one that must be fetched has not arrived (it could answer no
        call before)."""
        try:
            path = self.fetch.folder if self.fetch else self._resolve(self.spec)
        except LookupError:  # the catalog's UnknownModel
            return None
        if path is None:
            return None
        return LocalModelAtHand(self._advertised_id(self.spec, path) or default_model_id(path), path)

    async def start_fetch(self) -> None:
        """Start fetching the model whole in the background when it must be fetched first (local_fetch.py)."""
        if self.fetch is None and self._hub_id:
            self.fetch = await fetch_unless_at_hand(self.spec, self._resolve, self._fetch_whole)
        if self.fetch is not None:
            self.fetch.start()

    async def model(self, compute: dict, *, wait_for_fetch: bool) -> LocalModel | None:
        """The whole model, loaded on first use as `compute` says (device, dtype, quantization: the catalog's
        use_compute); None while it is fetched (unless `wait_for_fetch`), or when it cannot be found now."""
        async with self._lock:
            if self._model is None:
                if self._loading is None:
                    try:
                        path = await (self.fetch.folder_at_hand(wait=wait_for_fetch) if self.fetch
                                      else self._folder(self.spec, None))
                    except LookupError as error:  # the catalog's UnknownModel: no local fallback now
                        log.warning("local model unavailable: %s", error)
                        return None
                    if path is None:  # still being fetched, or its fetch failed (logged)
                        return None
                    self._loading = asyncio.create_task(self._load(path, compute), name="local-model-load")
                    # Its failure is the next awaiting call's to raise; none may come (shutdown): never "unretrieved".
                    self._loading.add_done_callback(lambda task: task.cancelled() or task.exception())
                loading = self._loading
                try:
                    await asyncio.shield(loading)
                finally:  # also when this call was cancelled: a load that finished meanwhile is kept
                    if loading.done():
                        self._settle(loading)
            return self._model

    def _settle(self, loading: asyncio.Task) -> None:
        """A finished load: its model and digest held, or (it failed) nothing, and the next fallback tries again."""
        self._loading = None
        if not loading.cancelled() and loading.exception() is None:
            self._model, self.weights_sha256 = loading.result()

    async def _load(self, path: Path, compute: dict) -> tuple[LocalModel, str]:
        """The model at `path` and its weights' digest, held together or not at all."""
        model = await on_compute_thread(
            load_full, path, model_id=self._advertised_id(self.spec, path), **compute, **self._kv_limits)
        try:
            digest = await asyncio.to_thread(weights_sha256, path)
            if self._closed:
                raise RuntimeError("the orchestrator stopped while its local model loaded")
        except BaseException:
            model.close()
            raise
        return model, digest

    def close(self) -> None:
        self._closed = True  # a load still under way closes what it loaded
        if self.fetch is not None:
            self.fetch.close()
        if self._model is not None:
            self._model.close()
