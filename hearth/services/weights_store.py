"""The community's weights in NATS JetStream's object store: what a stored checkpoint is, fetched by layer range.

`hearth weights publish` (hearth/services/weights_publish.py) stores a safetensors checkpoint in the bucket
WEIGHTS_BUCKET under its name: one object per decoder layer (its tensors as one safetensors blob, as stored), one for
every tensor outside the layers (embedding, final norm, lm_head: the "head"), one per config/tokenizer/chat template
file, and last a manifest listing each object with its size and SHA-256 plus the original checkpoint's
weights_sha256. A GGUF is stored with its bytes kept (hearth/inference/gguf_parts.py): its header as one object in
place of the files, each layer's and the head's tensor data in their block types (tensors every layer reads, such as
rope_freqs, apart), and the manifest's `gguf` section saying where each tensor lies. `store:NAME` is fetched into
$HEARTH_CACHE_DIR/store/NAME (default ~/.cache/hearth): only the objects a layer range (or the head) needs, each
checked against the manifest, assembled into a folder the loader reads (hearth/inference/partial_checkpoint.py; for a
GGUF, a GGUF of only those tensors) advertising the original checkpoint's digest. Who may write and read the bucket:
hearth/services/broker/permissions.py; how much it may hold: hearth/services/broker/weights_bucket.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator

from hearth.inference.cache_ranges import hold_range, remove_superseded_ranges
from hearth.inference.cache_versions import hold_version, remove_unused_versions
from hearth.inference.checksum import PARTIAL_CHECKPOINT_MARKER
from hearth.formats.cache_layout import STORE_CACHE_FOLDER, hearth_cache_dir
from hearth.formats.gguf_support import GGUF_SUFFIX
from hearth.inference.gguf_checkpoint import default_read_device
from hearth.inference.gguf_parts import StoredLayout
from hearth.inference.partial_checkpoint import NeededTensors, assemble_partial_folder, check_needed, \
    complete_partial_folder, remove_abandoned, selection_name
from hearth.services.broker.permissions import WEIGHTS_BUCKET
from hearth.services.weights_objects import ObjectMissing, WeightsStoreError, fetch_object, object_intact, \
    read_small_object

log = logging.getLogger(__name__)
T = TypeVar("T")

STORE_MODEL_PREFIX = "store:"
MANIFEST_OBJECT = "manifest.json"
MANIFEST_MAX_BYTES = 4 << 20
MAX_STORED_OBJECTS = 4096
MAX_MODEL_NAME_CHARS = 64
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
HEAD_OBJECT = "head.safetensors"
LAYER_OBJECT_FORMAT = "layer-{:05d}.safetensors"
GGUF_HEADER_OBJECT = "gguf-header.bin"
GGUF_HEAD_OBJECT = "head.gguf-data"
GGUF_LAYER_OBJECT_FORMAT = "layer-{:05d}.gguf-data"
GGUF_EVERY_LAYER_OBJECT = "every-layer.gguf-data"
# The manifest's format_version: 1 for safetensors, 2 for a GGUF (a host that predates it refuses the manifest).
GGUF_FORMAT_VERSION = 2
SHA256_PATTERN = r"^[0-9a-f]{64}$"
# An object's file name: not "." or "..", nor a dot first as the cache's partial downloads are named.
OBJECT_FILE_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
OBJECT_FILE_MAX_CHARS = 200
OBJECTS_VERSION_PATTERN = r"^[0-9a-f]{16}$"
# Object-store chunks (nats-py's default is 128 KiB): larger chunks mean fewer messages per layer.
OBJECT_CHUNK_BYTES = 512 * 1024
# Publications of one model a fetch tries when each is replaced (its objects deleted) while it is fetched.
FETCH_PUBLICATION_ATTEMPTS = 3


class StoredObject(BaseModel):
    """One object of a stored checkpoint: a file to place in the loader's folder under `file`."""

    file: str = Field(max_length=OBJECT_FILE_MAX_CHARS, pattern=OBJECT_FILE_PATTERN)
    kind: Literal["file", "layer", "head", "gguf_header", "every_layer"]
    layer: int | None = Field(default=None, ge=0, le=100_000)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_PATTERN)


class TensorSpec(BaseModel):
    """A stored tensor's dtype (safetensors' name, e.g. "BF16") and shape: what a host sizes its range from before
    fetching anything."""

    dtype: str = Field(max_length=16)
    # Each dimension at most 2^40: no real tensor comes near, and a negative or huge one would size a range wrong.
    shape: list[Annotated[int, Field(ge=0, le=2**40)]] = Field(max_length=8)


class WeightsManifest(BaseModel):
    """What a stored checkpoint is made of: the manifest object, the last one published."""

    format_version: Literal[1, 2] = 1
    name: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    num_layers: int = Field(ge=1, le=100_000)
    weights_sha256: str = Field(pattern=SHA256_PATTERN)
    objects: list[StoredObject] = Field(max_length=MAX_STORED_OBJECTS)
    # Tensor name -> the object file holding it.
    weight_map: dict[str, str] = Field(max_length=1_000_000)
    # Tensor name -> its dtype and shape (empty in a manifest published before hosts sized ranges from it).
    tensors: dict[str, TensorSpec] = Field(default_factory=dict, max_length=1_000_000)
    # How a GGUF's objects form it again (format_version 2; its tensors' dtypes above are GGML type names).
    gguf: StoredLayout | None = None
    # This publication's key prefix (object_key): an interrupted republish leaves the previous manifest's objects as
    # they were. None: stored before publications had keys of their own (NAME/FILE).
    objects_version: str | None = Field(default=None, pattern=OBJECTS_VERSION_PATTERN)

    @field_validator("objects")
    @classmethod
    def _one_object_per_file(cls, objects: list[StoredObject]) -> list[StoredObject]:
        files = [stored.file for stored in objects]
        if len(set(files)) != len(files) or PARTIAL_CHECKPOINT_MARKER in files:
            raise ValueError("its objects' files are not distinct names a checkpoint's files may have")
        return objects

    @model_validator(mode="after")
    def _objects_fit_the_layers(self) -> WeightsManifest:
        # What needed_objects and the loader take for granted: a layer object states its layer, and only layer
        # objects do (one past num_layers may be a checkpoint's extra, such as a multi-token-prediction layer);
        # every tensor (and a GGUF's every placement) lies in an object listed.
        for stored in self.objects:
            if (stored.kind == "layer") != (stored.layer is not None):
                raise ValueError(f"its object {stored.file} of kind {stored.kind!r} states layer {stored.layer}")
        files = {stored.file for stored in self.objects}
        placed = [placement.file for placement in self.gguf.placements] if self.gguf is not None else []
        if unlisted := next((file for file in (*self.weight_map.values(), *placed) if file not in files), None):
            raise ValueError(f"it places tensors in {unlisted[:80]!r}, which none of its objects is")
        return self

    def needed_objects(self, needed: NeededTensors) -> list[StoredObject]:
        """The objects a layer range, the head (None: everything) needs, files always."""
        def wanted(stored: StoredObject) -> bool:
            if stored.kind in ("file", "gguf_header", "every_layer") or needed is None:
                return True
            if needed == "head":
                return stored.kind == "head"
            return stored.kind == "layer" and needed[0] <= stored.layer <= needed[1]
        return [stored for stored in self.objects if wanted(stored)]

    def digest(self) -> str:
        """SHA-256 of what this manifest states, whichever keys its objects were published under."""
        return hashlib.sha256(self.model_dump_json(exclude={"objects_version"}).encode()).hexdigest()

    def layer_tensor_specs(self) -> list[tuple[str, str, list[int]]]:
        """Each tensor's (name, stored type, shape) as inference.memory.layer_weight_bytes_of takes them (a GGUF's
        layer tensors named by their layer, of their block types), from the manifest alone."""
        from hearth.inference.gguf_layout import gguf_layer_of

        if not self.tensors:
            raise WeightsStoreError(f"the manifest of {self.name!r} lists no tensor shapes: publish it again")
        if self.gguf is not None:
            return [(f"layers.{gguf_layer_of(name)}.{name}", spec.dtype, spec.shape)
                    for name, spec in self.tensors.items() if gguf_layer_of(name) is not None]
        return [(name, spec.dtype, spec.shape) for name, spec in self.tensors.items()]

    def layer_weight_bytes(self, compute_dtype, quantization, device=default_read_device) -> list[int]:
        """Bytes each decoder layer takes once loaded in `compute_dtype` under `quantization` on `device`
        (inference.memory.layer_weight_bytes_of), from the manifest alone."""
        from hearth.inference.memory import layer_weight_bytes_of

        per_layer = layer_weight_bytes_of(self.layer_tensor_specs(), compute_dtype, quantization, device=device)
        missing = [index for index in range(self.num_layers) if not per_layer.get(index)]
        if missing:  # a layer that seemed to weigh nothing would be taken on for free
            raise WeightsStoreError(f"the manifest of {self.name!r} lists no tensor of layer {missing[0]} "
                                    f"({len(missing)} of {self.num_layers} layers): publish it again")
        return [per_layer[index] for index in range(self.num_layers)]


def check_model_name(name: str) -> str:
    """`name` when it can name a stored model; WeightsStoreError otherwise."""
    if len(name) > MAX_MODEL_NAME_CHARS or not MODEL_NAME_RE.fullmatch(name):
        raise WeightsStoreError(f"model name {name[:80]!r} must be 1-{MAX_MODEL_NAME_CHARS} letters, digits, "
                                "'_', '.' or '-', starting with a letter or digit")
    return name


def store_model_name(model: str) -> str | None:
    """NAME of a `store:NAME` model string, else None."""
    return check_model_name(model[len(STORE_MODEL_PREFIX):]) if model.startswith(STORE_MODEL_PREFIX) else None


def object_key(name: str, file: str, version: str | None = None) -> str:
    """The bucket key of `file` of stored model `name`, published as `version` (None: the manifest's own key, or an
    object published before publications had keys of their own)."""
    return f"{name}/{file}" if version is None else f"{name}/{version}/{file}"


def progress_bar(total_bytes: int, description: str):
    """A byte progress bar on stderr, none when stderr is no terminal."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=description, leave=False,
                disable=None)  # disable=None: no bar when stderr is not a terminal


async def open_bucket(js):
    """The weights bucket; WeightsStoreError when the broker has none. Its bound is the steward's to set
    (hearth/services/broker/weights_bucket.py)."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.object_store(WEIGHTS_BUCKET)
    except BucketNotFoundError:
        raise WeightsStoreError(f"the broker has no {WEIGHTS_BUCKET!r} object store: nothing was published") \
            from None


async def read_manifest(js, name: str) -> WeightsManifest:
    """The manifest of stored model `name`; WeightsStoreError when absent, oversized or malformed."""
    from nats.js.errors import ObjectNotFoundError
    from pydantic import ValidationError

    await open_bucket(js)  # one clear line when nothing was ever published
    try:
        data = await read_small_object(js, object_key(name, MANIFEST_OBJECT), f"the manifest of {name!r}",
                                       MANIFEST_MAX_BYTES)
    except ObjectNotFoundError:
        raise WeightsStoreError(f"no model {name!r} in the community's store (`hearth weights list`)") from None
    try:
        manifest = WeightsManifest.model_validate_json(data)
    except ValidationError as error:
        raise WeightsStoreError(f"the manifest of {name!r} is malformed: {error.errors()[0]['msg']}") from None
    if manifest.name != name:
        raise WeightsStoreError(f"the manifest stored as {name!r} names {manifest.name!r}")
    return manifest


async def list_models(js) -> list[tuple[str, WeightsManifest | WeightsStoreError]]:
    """Every stored model by name, with its manifest or why that cannot be read: one unreadable manifest (malformed,
    or of a format this hearth predates) does not hide the others."""
    from nats.js.errors import NotFoundError

    store = await open_bucket(js)
    try:
        infos = await store.list()
    except NotFoundError:  # an empty bucket
        return []
    names = sorted(info.name[:-len(MANIFEST_OBJECT) - 1] for info in infos  # not an object named manifest.json
                   if info.name.endswith("/" + MANIFEST_OBJECT) and info.name.count("/") == 1 and not info.deleted)
    listed: list[tuple[str, WeightsManifest | WeightsStoreError]] = []
    for name in names:
        try:
            listed.append((name, await read_manifest(js, name)))
        except WeightsStoreError as error:
            listed.append((name, error))
    return listed


async def fetch_stored_model(js, name: str, needed: NeededTensors, *, cache_dir: Path | None = None) -> Path:
    """A loadable folder (for a GGUF: the GGUF file, NAME.gguf) holding what `needed` asks for of stored model `name`
    ((lo, hi), "head" or None for all): objects already cached and intact are kept, the others fetched and checked
    against the manifest's SHA-256. A publication replaced while it is fetched (its objects deleted) is left for the
    one that replaced it, up to FETCH_PUBLICATION_ATTEMPTS times."""
    needed = check_needed(needed)
    manifest = await read_manifest(js, check_model_name(name))
    for _ in range(FETCH_PUBLICATION_ATTEMPTS - 1):
        try:
            return await _fetch_publication(js, manifest, needed, cache_dir)
        except ObjectMissing:
            replacing = await read_manifest(js, name)
            if (replacing.objects_version, replacing.digest()) == (manifest.objects_version, manifest.digest()):
                raise  # not republished: this publication lacks it
            log.info("%s was republished while it was fetched: fetching the new publication", name)
            manifest = replacing
    return await _fetch_publication(js, manifest, needed, cache_dir)


async def _fetch_publication(js, manifest: WeightsManifest, needed: NeededTensors, cache_dir: Path | None) -> Path:
    name = manifest.name
    if isinstance(needed, tuple) and needed[1] >= manifest.num_layers:
        raise WeightsStoreError(f"{name!r} has {manifest.num_layers} layers: no layer {needed[1]}")
    model_dir = (cache_dir or hearth_cache_dir()) / STORE_CACHE_FOLDER / name
    root = model_dir / manifest.weights_sha256[:16]
    # Side files are no part of weights_sha256: they, and the folders linking them, are kept per manifest.
    published, gguf_name = root / manifest.digest()[:16], f"{name}{GGUF_SUFFIX}"
    target = published / selection_name(needed)
    await asyncio.to_thread(_hold_publication, model_dir, root, published, target)
    if (done := complete_partial_folder(target)) is not None:
        return done / gguf_name if manifest.gguf else done
    wanted = manifest.needed_objects(needed)
    files = {stored.file: (published / "files" if stored.kind == "file" else root / "objects") / stored.file
             for stored in wanted}
    for folder in {file.parent for file in files.values()}:
        folder.mkdir(parents=True, exist_ok=True)
    missing = [stored for stored in wanted if not await asyncio.to_thread(object_intact, files[stored.file], stored)]
    missing_bytes, started = sum(stored.size for stored in missing), time.monotonic()
    part = selection_name(needed).replace("layers-", "layers ", 1)  # "layers 2-3", "head" or "all"
    if missing:  # said in the log too: a service's log is a file, where the bar below is not drawn
        log.info("fetching %s of %s from the community's store: %d objects, %.1f MB", part, name, len(missing),
                 missing_bytes / 1e6)
    with progress_bar(missing_bytes, f"fetching {name}") as bar:
        for stored in missing:
            await fetch_object(js, object_key(name, stored.file, manifest.objects_version), name, stored,
                               files[stored.file].parent, progress=bar.update)
    if missing:
        log.info("fetched %s of %s in %.1f s", part, name, time.monotonic() - started)
    if manifest.gguf is not None:
        fetched = await asyncio.to_thread(_write_gguf, manifest, target, gguf_name, files)
    else:
        fetched = await asyncio.to_thread(assemble_partial_folder, target, files, manifest.weight_map,
                                          weights_sha256=manifest.weights_sha256,
                                          source=f"{STORE_MODEL_PREFIX}{name}")
    # A complete folder of this publication is written: earlier publications' folders no process uses can go, and
    # so can this one's other ranges no process uses (hearth/inference/cache_ranges.py).
    await asyncio.to_thread(remove_unused_versions, model_dir, {root})
    await asyncio.to_thread(remove_unused_versions, root, {published, root / "objects"})
    await asyncio.to_thread(remove_abandoned, published / "files")  # the other folders: remove_superseded_ranges
    await asyncio.to_thread(remove_superseded_ranges, root, [published], root / "objects",
                            lambda selected: {stored.file for stored in manifest.needed_objects(selected)
                                              if stored.kind != "file"}, written=target.name)
    return fetched


def _hold_publication(model_dir: Path, root: Path, published: Path, target: Path) -> None:
    """Hold the folders of this weights digest and this manifest in use while this process runs
    (hearth/inference/cache_versions.py), and the selection `target` until released (cache_ranges.py)."""
    from hearth.inference.errors import CheckpointError

    try:
        hold_version(model_dir, root)
        hold_version(root, published)
        hold_range(root, target)
    except CheckpointError as error:
        raise WeightsStoreError(str(error)) from None


def _write_gguf(manifest: WeightsManifest, target: Path, gguf_name: str, files: dict[str, Path]) -> Path:
    from hearth.inference.errors import CheckpointError
    from hearth.inference.gguf_parts import write_gguf_folder

    try:
        return write_gguf_folder(target, gguf_name, GGUF_HEADER_OBJECT, manifest.gguf, files,
                                 weights_sha256=manifest.weights_sha256, source=f"{STORE_MODEL_PREFIX}{manifest.name}")
    except CheckpointError as error:
        raise WeightsStoreError(f"{manifest.name!r}: {error}") from None


async def refusals_told(nc, work: Awaitable[T]) -> T:
    """What `work` gives, or WeightsStoreError naming what the broker refused `nc` (made by connect_nats) for its
    key's permissions, as soon as it does: nats-py tells that only to the error callback, and the JetStream
    request it refused would just time out."""
    from hearth.services.broker.connection import broker_refusal, refused_event

    work_task = asyncio.ensure_future(work)
    refused = refused_event(nc) or asyncio.Event()
    refused_task = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait((work_task, refused_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled() and refused.is_set():
        raise _refused_error(broker_refusal(nc))
    try:
        return work_task.result()
    except Exception as error:
        if isinstance(error, WeightsStoreError) or (refusal := broker_refusal(nc)) is None:
            raise
        raise _refused_error(refusal) from None


def _refused_error(refusal: str | None) -> WeightsStoreError:
    return WeightsStoreError(f"the broker refused this key ({refusal}): on a community mesh only the steward's "
                             "system key publishes, and shard hosts and orchestrators read")


async def resolve_model_source(model: str, needed: NeededTensors, *, nats_url: str | None, settings) -> Path:
    """The local folder for `model`: `store:NAME` fetched from the community's store (only what `needed` asks
    for), anything else through inference's resolve_model_path (a hub id downloads only what `needed` asks for)."""
    from hearth.inference import resolve_model_path
    from hearth.services.broker.connection import close_quietly, connect_nats

    name = store_model_name(model)
    if name is None:
        return await asyncio.to_thread(resolve_model_path, model, needed_layers=needed)
    nc = await connect_nats(nats_url, name=f"hearth weights {name}", settings=settings.nats)
    try:
        return await refusals_told(nc, fetch_stored_model(nc.jetstream(), name, needed))
    finally:
        await close_quietly(nc, settings.nats.close_timeout_s)
