"""ModelCatalog: resolves a requested model name to its head, tokenizer and weights digest, loading on first use."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from inference import CheckpointError, Head, LocalModel, load_full, load_head, resolve_model_path, weights_sha256

from inference.compute_thread import on_compute_thread

log = logging.getLogger(__name__)

BUNDLED_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


class UnknownModel(LookupError):
    """No checkpoint of that name can be found on this orchestrator's machine."""


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    path: Path
    head: Head
    weights_sha256: str


class ModelCatalog:
    """Heads are loaded once per model and shared by every request (a Head is stateless)."""

    def __init__(self, search_dirs: list[Path] | None = None, local_model: str | None = None) -> None:
        self.search_dirs = [Path(d) for d in (search_dirs or [])] + [BUNDLED_MODELS_DIR]
        self.local_model_spec = local_model
        self._loaded: dict[str, LoadedModel] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._local: LocalModel | None = None
        self._local_lock = asyncio.Lock()

    def resolve(self, model: str) -> Path:
        """A folder for `model`: a path, a folder of that name in a search dir, or a hub id in the local cache."""
        as_path = Path(model).expanduser()
        if as_path.is_dir():
            return as_path.resolve()
        if "/" not in model.strip("/") or model.count("/") == 1:
            for directory in self.search_dirs:
                candidate = directory / model
                if (candidate / "config.json").is_file():
                    return candidate.resolve()
        try:
            return resolve_model_path(model, local_files_only=True)
        except CheckpointError as error:
            raise UnknownModel(f"unknown model {model!r}: {error}") from None

    def advertised_id(self, model: str, path: Path) -> str | None:
        """The model id shards loading `model` advertise: the hub id itself, or None (the folder's name)."""
        as_given = Path(model).expanduser()
        if as_given.is_dir() or any(path == (d / model).resolve() for d in self.search_dirs):
            return None
        return model

    def local_model_id(self) -> str | None:
        """The id of the model this orchestrator may run whole (local fallback), as shards would advertise it."""
        if self.local_model_spec is None:
            return None
        try:
            path = self.resolve(self.local_model_spec)
        except UnknownModel:
            return None
        return self.advertised_id(self.local_model_spec, path) or path.name

    async def get(self, model: str) -> LoadedModel:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            if model not in self._loaded:
                path = await asyncio.to_thread(self.resolve, model)
                # A hub id names the model as the shards advertise it; the snapshot folder's name would not.
                head = await on_compute_thread(load_head, path, model_id=self.advertised_id(model, path))
                digest = await asyncio.to_thread(weights_sha256, path)
                self._loaded[model] = LoadedModel(head.info.model_id, path, head, digest)
                log.info("loaded head of %s (weights %s)", head.info.model_id, digest[:12])
            return self._loaded[model]

    async def local_model_for(self, loaded: LoadedModel) -> LocalModel | None:
        """The whole model for local fallback, when this orchestrator was given the same checkpoint."""
        if self.local_model_spec is None:
            return None
        async with self._local_lock:
            if self._local is None:
                path = await asyncio.to_thread(self.resolve, self.local_model_spec)
                self._local = await on_compute_thread(
                    load_full, path, model_id=self.advertised_id(self.local_model_spec, path))
                self._local_digest = await asyncio.to_thread(weights_sha256, path)
        if self._local.info.model_id != loaded.model_id or self._local_digest != loaded.weights_sha256:
            return None
        return self._local

    async def preload(self, model: str) -> None:
        await self.get(model)
        if self.local_model_spec:
            await self.local_model_for(self._loaded[model])

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
