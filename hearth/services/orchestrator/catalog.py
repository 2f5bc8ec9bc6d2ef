"""ModelCatalog: resolves a model name to its head, tokenizer and weights digest, loading on first use.

Two doors, because a request is not the operator. What the operator configured (`--preload`, `--local-model`)
may be a folder path, `store:NAME` (fetched from the community's store: the head only, or the whole model for
the local fallback) or a hub id (`org/name`, `org/name:FILE.gguf`; when not in the local hub cache, fetched as
shard hosts fetch their ranges: the head only, a GGUF's by byte ranges, or the whole model for the local
fallback). A name in a request is only ever looked up in the catalog: a configured name (NAME for a configured
`store:NAME`, the local model's id), the id of a loaded model, a name inside a models folder (`--models-dir`,
`models/`: a checkpoint folder's or a folder's holding one GGUF, a GGUF file's stem), a hub id (`org/name`) already in
the local hub cache, or a hub id (`org/name`, `org/name:FILE.gguf`) that live shards advertise (its head fetched then,
as for the operator's). A request's name is never opened as a path, and what a request is told about a name it may
not use carries no path of this machine.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.inference import CheckpointError, Head, LocalModel, load_head, resolve_model_path, weights_sha256
from hearth.inference.checkpoint import models_folder_entry, read_config_dict
from hearth.inference.checkpoint_files import HUB_ALLOW_PATTERNS
from hearth.inference.errors import InferenceError, first_line
from hearth.inference.hub_ids import is_hub_gguf_id
from hearth.inference.ollama_models import canonical_ollama_name, is_ollama_model, served_model_id
from hearth.inference.compute_thread import on_compute_thread
from hearth.inference.heap import release_freed_heap
from hearth.inference.quantization import QuantizationScheme, parse_quantization
from hearth.inference.token_bounds import TokenLowerBound
from hearth.inference.partial_checkpoint import NeededTensors
from hearth.protocol.quantization_labels import AUTO_QUANTIZATION, accepts
from hearth.services.common.config_processes import ShardSettings
from hearth.services.common.hearth_files import data_dir
from hearth.services.orchestrator.local_fetch import on_daemon_thread
from hearth.services.orchestrator.local_model import LocalModelAtHand, LocalModelHolder
from hearth.services.weights_store import STORE_MODEL_PREFIX, WeightsStoreError, fetch_stored_model, store_model_name

log = logging.getLogger(__name__)

BUNDLED_MODELS_DIR = data_dir("models")
# One path component that cannot climb out of its folder ("." and ".." start with a dot) or name a hidden one.
FOLDER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A hub id, "org/name": two such components.
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# config.json keys that give a model's context length, in the order architectures use them.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a hub model: "org/name", or "org/name:FILE.gguf"."""
    return bool(HUB_ID_PATTERN.match(model)) or is_hub_gguf_id(model)


class UnknownModel(LookupError):
    """No model of that name is in this orchestrator's catalog; the message names no path."""


class LocalModelUnusable(RuntimeError):
    """The model this orchestrator may run whole (its --local-model) does not load; the message says why."""


def _canonical_or_none(model: str) -> str | None:
    """An Ollama model's canonical name, None for anything else or a malformed one."""
    if not is_ollama_model(model):
        return None
    try:
        return canonical_ollama_name(model)
    except CheckpointError:
        return None


def stored_name(model: str) -> str | None:
    """NAME of a `store:NAME` model (the id its shards advertise), else None; UnknownModel for a malformed NAME."""
    try:
        return store_model_name(model)
    except WeightsStoreError as error:
        raise UnknownModel(str(error)) from None


def context_length(checkpoint: Path) -> int | None:
    """Positions the model takes (prompt plus generated tokens), from its config.json (a GGUF's metadata); None when
    unknown."""
    try:
        config = read_config_dict(checkpoint)
    except (OSError, ValueError, CheckpointError):
        return None
    for key in CONTEXT_LENGTH_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    path: Path
    head: Head
    weights_sha256: str
    # Positions the model takes; None when its config does not say (then no context check is possible).
    context_length: int | None = None
    # How many tokens a text needs at least, without tokenizing it (None: the head has no tokenizer).
    token_bound: TokenLowerBound | None = None


class ModelCatalog:
    """Heads are loaded once per model and shared by every request (a Head is stateless)."""

    def __init__(self, search_dirs: list[Path] | None = None, local_model: str | None = None, *,
                 shard_settings: ShardSettings | None = None) -> None:
        self.search_dirs = [Path(d) for d in (search_dirs or [])] + [BUNDLED_MODELS_DIR]
        self.local_model_spec = local_model
        # What the operator named (preloads, the local model): a request may name these as they were given.
        self._configured: set[str] = {local_model} if local_model else set()
        self._loaded: dict[str, LoadedModel] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.local = LocalModelHolder(
            local_model, resolve=self.resolve, folder=self.folder, advertised_id=self.advertised_id,
            hub_id=is_hub_id(local_model), shard_settings=shard_settings or ShardSettings()) if local_model else None
        # Where heads (and the local model) compute: the CPU in the checkpoint's dtype until told (use_compute).
        self._compute: dict = {}
        # How `store:NAME` models are fetched (use_store), and the folder each was fetched into.
        self._store_fetch: Callable[[str, NeededTensors], Awaitable[Path]] | None = None
        self._store_folders: dict[str, Path] = {}
        # Hub ids the operator named that were not in the local cache: what was fetched of each (head, or None:
        # the whole model) and where.
        self._hub_folders: dict[str, dict[NeededTensors, Path]] = {}
        # Whether live shards advertise a model id (use_advertised); a read of the routing read model.
        self._is_advertised: Callable[[str], bool] | None = None
        # Advertised models a request named that this orchestrator has no head for: its operator was told.
        self._headless_warned: set[str] = set()

    def use_compute(self, device, dtype, quantization: QuantizationScheme | str = "none") -> None:
        """Load heads and the local model onto `device` (a torch.device) in `dtype` (inference.devices), their
        weights held as `quantization` says (inference.quantization; auto: each checkpoint as it stores them,
        inference.stored_precision)."""
        self._compute = {"device": device, "dtype": dtype, "quantization": quantization}

    def use_store(self, jetstream) -> None:
        """Fetch `store:NAME` models from the community's store through `jetstream` (the orchestrator's own
        connection's JetStream context)."""
        self._store_fetch = lambda name, needed: fetch_stored_model(jetstream, name, needed)

    def use_advertised(self, is_advertised: Callable[[str], bool]) -> None:
        """Let a request name a hub id that `is_advertised` (blocking: run on a worker thread) says live shards
        serve, though the operator did not configure it: its head is fetched from the hub on first use."""
        self._is_advertised = is_advertised

    async def folder(self, model: str, needed: NeededTensors) -> Path:
        """resolve() on a worker thread; a `store:NAME` model is fetched from the community's store instead (only
        `needed`: "head", or None for the whole model), every wait bounded (hearth/services/weights_store.py)."""
        name = stored_name(model)
        if name is None:
            fetched = self._hub_folders.get(model, {})
            if needed in fetched:
                return fetched[needed]
            if not fetched:
                try:
                    return await asyncio.to_thread(self.resolve, model)
                except UnknownModel:
                    if not is_hub_id(model):
                        raise
            return await self._fetch_hub(model, needed)
        if self._store_fetch is None:
            raise UnknownModel(f"unknown model {model!r}: this orchestrator is not connected to the store")
        try:
            folder = await self._store_fetch(name, needed)
        except WeightsStoreError as error:
            raise UnknownModel(f"unknown model {model!r}: {error}") from None
        except Exception as error:  # the broker's refusals and timeouts
            raise UnknownModel(f"unknown model {model!r}: the store is not reachable ({type(error).__name__})") \
                from None
        self._store_folders[model] = folder
        return folder

    async def _fetch_hub(self, model: str, needed: NeededTensors) -> Path:
        """What `needed` asks for of a hub id the operator named (a GGUF's by byte ranges:
        hearth/inference/hub_fetch.py), kept for resolve()."""
        try:
            folder = await on_daemon_thread(resolve_model_path, model, needed_layers=needed)  # see local_fetch.py
        except CheckpointError as error:
            raise UnknownModel(f"unknown model {model!r}: {error}") from None
        self._hub_folders.setdefault(model, {})[needed] = folder
        return folder

    def resolve(self, model: str) -> Path:
        """A folder for `model`: a path, a folder of that name in a search dir, or a hub id in the local cache (a
        `store:NAME` model, or a hub id not in that cache, only once `folder` has fetched it: this never waits on
        the network)."""
        if stored_name(model) is not None:
            if model not in self._store_folders:
                raise UnknownModel(f"model {model!r} is not fetched from the store yet")
            return self._store_folders[model]
        if fetched := self._hub_folders.get(model):
            return fetched.get(None) or next(iter(fetched.values()))
        as_path = Path(model).expanduser()
        if as_path.exists():
            try:
                return resolve_model_path(as_path)  # a folder, or the GGUF file it (or the path) names
            except CheckpointError as error:
                raise UnknownModel(f"unknown model {model!r}: {error}") from None
        if ("/" not in model.strip("/") or model.count("/") == 1) and (found := self._in_search_dirs(model)):
            return found
        try:
            return resolve_model_path(model, local_files_only=True)
        except CheckpointError as error:
            raise UnknownModel(f"unknown model {model!r}: {error}") from None

    def _in_search_dirs(self, name: str) -> Path | None:
        """The checkpoint the first models folder holding `name` holds under it (models_folder_entry), or None."""
        return next((found for directory in self.search_dirs
                     if (found := models_folder_entry(directory, name)) is not None), None)

    def advertised_id(self, model: str, path: Path) -> str | None:
        """The model id shards loading `model` advertise: the hub id itself, a stored model's name, or None (the
        folder's name)."""
        if (name := stored_name(model)) is not None:
            return name
        as_given = Path(model).expanduser()
        if as_given.exists() or path == self._in_search_dirs(model):
            return None
        return served_model_id(model)

    def local_model_at_hand(self) -> LocalModelAtHand | None:
        """The model this orchestrator may run whole (local fallback): its id, as shards would advertise it, and its
        folder, from one resolution (blocking); None when there is none, or not yet (local_model.py)."""
        return self.local.at_hand() if self.local is not None else None

    def local_model_id(self) -> str | None:
        """The id of the model this orchestrator may run whole (local_model_at_hand)."""
        return at_hand.model_id if (at_hand := self.local_model_at_hand()) is not None else None

    async def start_local_fetch(self) -> None:
        """Start fetching the local model whole in the background when it must be fetched first (local_fetch.py)."""
        if self.local is not None:
            await self.local.start_fetch()

    def catalog_path(self, name: str) -> Path | None:
        """The folder of a catalog name (see the module docstring), or None; never takes `name` as a path."""
        if FOLDER_NAME_PATTERN.match(name) and (found := self._in_search_dirs(name)):
            return found
        if HUB_ID_PATTERN.match(name) and ".." not in name:
            from huggingface_hub import snapshot_download

            try:
                return Path(snapshot_download(name, local_files_only=True, allow_patterns=HUB_ALLOW_PATTERNS))
            except Exception:  # not in the cache, or not a valid id: not in the catalog either way
                return None
        return None

    def path_of_id(self, model_id: str, local: LocalModelAtHand | None) -> Path | None:
        """The folder of a model id that shard hosts advertise, looked up as a request's name is (never as a
        path), or None; `local` is the local model as local_model_at_hand found it for the same answer (one
        resolution serves every id)."""
        if (loaded := self.loaded_of_id(model_id)) is not None:
            return loaded.path
        if local is not None and model_id == local.model_id:
            return local.path
        return self.catalog_path(model_id)

    def loaded_of_id(self, model_id: str) -> LoadedModel | None:
        """The model loaded here (its head) that shard hosts advertise as `model_id`, or None."""
        return next((loaded for loaded in list(self._loaded.values()) if loaded.model_id == model_id), None)

    async def get(self, model: str) -> LoadedModel:
        """The model an operator named (a path, a folder name or a hub id), loaded on first use."""
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            if model not in self._loaded:
                path = await self.folder(model, "head")
                # A hub id names the model as the shards advertise it; the snapshot folder's name would not.
                await self._load(model, path, self.advertised_id(model, path))
            return self._loaded[model]

    async def get_requested(self, name: str) -> LoadedModel:
        """The model a request names, from the catalog only; UnknownModel (naming no path) otherwise."""
        configured = self._configured_as(name)
        if configured is None and self.local_model_spec and name == await asyncio.to_thread(self.local_model_id):
            configured = self.local_model_spec  # a path's: named by the id llm.models lists it under
        if configured is not None:
            try:
                return await self.get(configured)
            except UnknownModel:  # its message may carry the operator's paths
                raise UnknownModel(f"model {name!r} cannot be found on this orchestrator") from None
        if (loaded := self.loaded_of_id(name)) is not None:
            return loaded
        path = await asyncio.to_thread(self.catalog_path, name)
        if path is None and is_hub_id(name):
            return await self._get_advertised_hub_model(name)
        if path is None:
            await self._refuse_headless_advertised(name)
            raise UnknownModel(f"unknown model {name!r}: not one this orchestrator serves (ask llm.models; a model "
                               f"is named by its id, never by a path)")
        # Only names that exist get a lock: a flood of made-up names leaves nothing behind.
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._loaded:
                try:
                    await self._load(name, path, name if HUB_ID_PATTERN.match(name) else None)
                except Exception as error:
                    log.warning("model %s could not be loaded from %s: %s", name, path, error)
                    raise UnknownModel(f"model {name!r} cannot be loaded on this orchestrator") from None
            return self._loaded[name]

    async def _refuse_headless_advertised(self, name: str) -> None:
        """UnknownModel saying so when live shards serve `name` but this orchestrator has no head for it (a GGUF's
        shards advertise the file's stem, which only `--preload PATH` or the file in a `--models-dir` names here); its
        operator is told once."""
        if self._is_advertised is None or not await asyncio.to_thread(self._is_advertised, name):
            return
        if name not in self._headless_warned:  # bounded: only names live shards advertise get here
            self._headless_warned.add(name)
            log.warning("a request asked for %s, which live shards serve, but this orchestrator has no head for it: "
                        "start it with --preload naming that model (its path, or store:NAME), or with a --models-dir "
                        "holding it", name)
        raise UnknownModel(f"model {name!r} is served by live shards, but this orchestrator has no head for it "
                           f"(its operator starts it with --preload naming the model)")

    async def _get_advertised_hub_model(self, name: str) -> LoadedModel:
        """A hub id a request names that the operator did not configure: loaded (its head only, from the hub
        cache or by the hub fetch shard hosts use) when live shards advertise it, else UnknownModel."""
        if self._is_advertised is None or not await asyncio.to_thread(self._is_advertised, name):
            raise UnknownModel(f"model {name!r} is not served: no live shard advertises it (ask llm.models)")
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._loaded:
                from hearth.inference.hub_fetch import fetch_hub_selection

                try:
                    # Straight to the hub fetch: a request's name is never tried as a path first.
                    folder = await asyncio.to_thread(fetch_hub_selection, name, "head", local_files_only=None)
                    await self._load(name, folder, name)
                except Exception as error:
                    log.warning("model %s could not be loaded from the hub: %s", name, error)
                    raise UnknownModel(f"model {name!r} is served by shards but this orchestrator cannot fetch "
                                       f"its head from the hub ({type(error).__name__})") from None
                self._hub_folders.setdefault(name, {})["head"] = folder
            return self._loaded[name]

    def _configured_as(self, name: str) -> str | None:
        """How the operator configured the model a request names `name`: as given, or `store:NAME` for NAME."""
        if name in self._configured:
            return name
        if is_ollama_model(name):  # any spelling of a configured Ollama model
            wanted = _canonical_or_none(name)
            if wanted is None:
                return None
            return next((spec for spec in sorted(self._configured) if _canonical_or_none(spec) == wanted), None)
        spec = f"{STORE_MODEL_PREFIX}{name}"
        return spec if spec in self._configured else None

    async def _load(self, key: str, path: Path, model_id: str | None) -> None:
        head = await on_compute_thread(load_head, path, model_id=model_id, **self._compute)
        digest = await asyncio.to_thread(weights_sha256, path)
        bound = await on_compute_thread(TokenLowerBound, head.tokenizer) if head.has_tokenizer else None
        length = await asyncio.to_thread(context_length, path)
        self._loaded[key] = LoadedModel(head.info.model_id, path, head, digest, length, bound)
        log.info("loaded head of %s (weights %s)", head.info.model_id, digest[:12])

    async def local_model_for(self, loaded: LoadedModel, quantization: str | None = None, *,
                              wait_for_fetch: bool = False) -> LocalModel | None:
        """The whole model for local fallback (None while fetched, unless `wait_for_fetch`), when this orchestrator was
        given the same checkpoint and holds it in a scheme that `quantization` (a call's; None: any) accepts."""
        setting = self._compute.get("quantization")
        if self.local is None or (setting != AUTO_QUANTIZATION
                                  and not accepts(quantization, parse_quantization(setting).label)):
            return None  # refused without loading it
        local = await self.local.model(self._compute, wait_for_fetch=wait_for_fetch)
        same_checkpoint = local is not None and (local.info.model_id, self.local.weights_sha256) == (
            loaded.model_id, loaded.weights_sha256)
        return local if same_checkpoint and accepts(quantization, local.runner.quantization) else None

    async def release_freed_heap(self) -> None:
        """Hand the heap that finished calls freed (a long prompt's embeddings, the local model's caches) back to
        the OS, on the compute thread; on the CPU only (CUDA memory is torch's caching allocator's). Why: glibc
        keeps freed fragments resident (hearth/inference/heap.py)."""
        if torch.device(self._compute.get("device", "cpu")).type == "cpu":
            await on_compute_thread(release_freed_heap)

    async def preload(self, model: str) -> None:
        """Load `model`'s head, then the local model beside it (LocalModelUnusable when that is what fails, so that
        the refusal names the local model, not `model`)."""
        self._configured.add(model)
        await self.get(model)
        if self.local_model_spec:
            try:
                await self.local_model_for(self._loaded[model], wait_for_fetch=True)
            except InferenceError as error:
                raise LocalModelUnusable(first_line(error)) from None

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
