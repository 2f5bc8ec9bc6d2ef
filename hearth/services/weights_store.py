"""The community's weights in NATS JetStream's object store: published once per layer, fetched by layer range.

`hearth weights publish` stores a safetensors checkpoint in the bucket WEIGHTS_BUCKET under its name: one object per
decoder layer (its tensors as one safetensors blob, as stored), one for every tensor outside the layers (embedding,
final norm, lm_head: the "head"), one per config/tokenizer/chat template file, and last a manifest listing each object
with its size and SHA-256 plus the original checkpoint's weights_sha256. A GGUF is stored with its bytes kept
(hearth/inference/gguf_parts.py): its header as one object in place of the files, each layer's and the head's tensor
data in their block types (tensors every layer reads, such as rope_freqs, apart), and the manifest's `gguf` section
saying where each tensor lies. `store:NAME` is fetched into $HEARTH_CACHE_DIR/store/NAME (default ~/.cache/hearth):
only the objects a layer range (or the head) needs, each checked against the manifest, assembled into a folder the
loader reads (hearth/inference/partial_checkpoint.py; for a GGUF, a GGUF of only those tensors) advertising the
original checkpoint's digest. Who may write and read the bucket: hearth/services/broker/permissions.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from hearth.inference.checksum import PARTIAL_CHECKPOINT_MARKER
from hearth.inference.gguf_header import GGUF_SUFFIX
from hearth.inference.gguf_checkpoint import default_read_device
from hearth.inference.gguf_parts import StoredLayout
from hearth.inference.partial_checkpoint import NON_WEIGHT_PATTERNS, NeededTensors, assemble_partial_folder, \
    check_needed, complete_partial_folder, hearth_cache_dir, layer_of, selection_name
from hearth.services.broker.permissions import WEIGHTS_BUCKET, WEIGHTS_STREAM
from hearth.services.weights_objects import WeightsStoreError, delete_objects_except, fetch_object, object_intact, \
    read_small_object

log = logging.getLogger(__name__)

STORE_MODEL_PREFIX = "store:"
STORE_CACHE_FOLDER = "store"
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
OBJECTS_VERSION_PATTERN = r"^[0-9a-f]{16}$"
# Object-store chunks (nats-py's default is 128 KiB): larger chunks mean fewer messages per layer.
OBJECT_CHUNK_BYTES = 512 * 1024


class StoredObject(BaseModel):
    """One object of a stored checkpoint: a file to place in the loader's folder under `file`."""

    # Not "." or "..", nor a dot first as the cache's partial downloads are named.
    file: str = Field(max_length=200, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
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

    def layer_weight_bytes(self, compute_dtype, quantization, device=default_read_device) -> list[int]:
        """Bytes each decoder layer takes once loaded in `compute_dtype` under `quantization` on `device`
        (inference.memory.layer_weight_bytes_of), from the manifest alone."""
        from hearth.inference.gguf_header import gguf_layer_of
        from hearth.inference.memory import layer_weight_bytes_of

        if not self.tensors:
            raise WeightsStoreError(f"the manifest of {self.name!r} lists no tensor shapes: publish it again")
        specs = ((name, spec.dtype, spec.shape) for name, spec in self.tensors.items())
        if self.gguf is not None:  # GGUF tensors by their block types (hearth/inference/memory.py)
            specs = ((f"layers.{gguf_layer_of(name)}.{name}", spec.dtype, spec.shape)
                     for name, spec in self.tensors.items() if gguf_layer_of(name) is not None)
        per_layer = layer_weight_bytes_of(specs, compute_dtype, quantization, device=device)
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


def _progress(total_bytes: int, description: str):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=description, leave=False,
                disable=None)  # disable=None: no bar when stderr is not a terminal


async def _bucket(js, *, create: bool):
    from nats.js.api import ObjectStoreConfig
    from nats.js.errors import BucketNotFoundError

    try:
        store = await js.object_store(WEIGHTS_BUCKET)
    except BucketNotFoundError:
        if not create:
            raise WeightsStoreError(f"the broker has no {WEIGHTS_BUCKET!r} object store: nothing was published") \
                from None
        store = await js.create_object_store(WEIGHTS_BUCKET, config=ObjectStoreConfig(
            description="hearth: checkpoints stored per layer (hearth weights publish)"))
    if create:  # the publisher, the only one who may administer its stream, holds its readers' consumers to limits
        await _limit_consumers(js)
    return store


async def _limit_consumers(js) -> None:
    from hearth.events.streams import consumer_limits, max_consumers_per_stream, weights_consumer_inactive_limit_s

    limits = consumer_limits(weights_consumer_inactive_limit_s)
    config = (await js.stream_info(WEIGHTS_STREAM)).config
    if config.max_consumers != max_consumers_per_stream or config.consumer_limits != limits:
        await js.update_stream(config.evolve(max_consumers=max_consumers_per_stream, consumer_limits=limits))


def _layer_blobs(folder: Path):
    """(object file, kind, layer, safetensors bytes, {tensor name: TensorSpec}) for each layer and the head, one
    at a time."""
    from safetensors.torch import save

    from hearth.inference.checkpoint import SAFETENSORS_DTYPES, SafetensorsCheckpoint
    from hearth.inference.checkpoint_files import opened_safetensors

    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

    file_of = SafetensorsCheckpoint(folder).file_of
    groups: dict[int | None, list[str]] = {}
    for tensor in sorted(file_of):
        groups.setdefault(layer_of(tensor), []).append(tensor)
    for layer in sorted(groups, key=lambda key: -1 if key is None else key):
        tensors = {}
        for tensor in groups[layer]:
            with opened_safetensors(file_of[tensor]) as handle:
                tensors[tensor] = handle.get_tensor(tensor)  # as stored: the store keeps the checkpoint's bytes
        file = HEAD_OBJECT if layer is None else LAYER_OBJECT_FORMAT.format(layer)
        specs = {tensor: TensorSpec(dtype=dtype_names[value.dtype], shape=list(value.shape))
                 for tensor, value in tensors.items()}
        yield file, ("head" if layer is None else "layer"), layer, save(tensors), specs


def _gguf_blobs(path: Path):
    """(the manifest's gguf section, the number of layers, the objects as _layer_blobs gives them, the header first)
    of the GGUF at `path` (hearth/inference/gguf_parts.py)."""
    from hearth.inference.gguf_parts import stored_parts

    layout, num_layers, parts = stored_parts(path, GGUF_HEADER_OBJECT, lambda layer: GGUF_HEAD_OBJECT if layer is None
                                             else GGUF_LAYER_OBJECT_FORMAT.format(layer), GGUF_EVERY_LAYER_OBJECT)
    return layout, num_layers, ((file, kind, layer, data, {tensor: TensorSpec(dtype=dtype, shape=shape)
                                                            for tensor, (dtype, shape) in specs.items()})
                                for file, kind, layer, data, specs in parts)


def _side_files(folder: Path) -> list[Path]:
    import fnmatch

    from hearth.inference.checkpoint_files import SAFETENSORS_INDEX_NAME

    return sorted(file for file in folder.iterdir() if file.is_file() and file.name != SAFETENSORS_INDEX_NAME
                  and any(fnmatch.fnmatch(file.name, pattern) for pattern in NON_WEIGHT_PATTERNS))


def check_publishable(path: Path) -> Path | None:
    """The GGUF file `path` names (itself, or a folder's one GGUF), checked as the loader checks it, or None for a
    safetensors checkpoint folder; WeightsStoreError (one line) for anything else."""
    from hearth.inference.errors import CheckpointError
    from hearth.inference.gguf_parts import publishable_gguf

    try:
        gguf = publishable_gguf(path)
    except CheckpointError as error:
        raise WeightsStoreError(str(error)) from None
    if gguf is None and not (path / "config.json").is_file():
        raise WeightsStoreError(f"{path} is not a checkpoint folder (no config.json) nor a GGUF file")
    return gguf


async def publish_checkpoint(js, folder: Path, name: str) -> WeightsManifest:
    """Store the checkpoint `folder` (a safetensors folder, a GGUF file or a folder holding one) as `name`
    (replacing what was there), one layer in memory at a time, under keys of this publication's own; the manifest
    goes last, so a reader never sees a manifest naming objects not yet stored or since rewritten, and only then are
    the objects it does not name deleted."""
    import secrets

    from hearth.inference import read_config_dict, weights_sha256
    from hearth.inference.errors import CheckpointError

    check_model_name(name)
    gguf = await asyncio.to_thread(check_publishable, folder)
    try:
        stored_gguf, num_layers, blobs = (await asyncio.to_thread(_gguf_blobs, gguf) if gguf else (
            None, int(read_config_dict(folder)["num_hidden_layers"]), _layer_blobs(folder)))
        digest = await asyncio.to_thread(weights_sha256, gguf or folder)
        layer_bytes = gguf.stat().st_size if gguf else sum(file.stat().st_size for file in folder.glob("*.safetensors"))
    except (CheckpointError, KeyError, ValueError, OSError) as error:
        raise WeightsStoreError(f"{folder} is not a checkpoint hearth can publish: {error}") from None
    store = await _bucket(js, create=True)
    objects: list[StoredObject] = []
    weight_map: dict[str, str] = {}
    tensor_specs: dict[str, TensorSpec] = {}
    version = secrets.token_hex(8)

    async def put(file: str, kind: str, layer: int | None, data: bytes) -> None:
        key = object_key(name, file, version)
        await store.put(key, data, meta=_chunked(key))
        objects.append(StoredObject(file=file, kind=kind, layer=layer, size=len(data),
                                    sha256=hashlib.sha256(data).hexdigest()))
        bar.update(len(data))

    with _progress(layer_bytes, f"publishing {name}") as bar:
        for side_file in [] if gguf else _side_files(folder):
            await put(side_file.name, "file", None, side_file.read_bytes())
        while (item := await asyncio.to_thread(next, blobs, None)) is not None:
            file, kind, layer, data, specs = item
            await put(file, kind, layer, data)
            weight_map.update(dict.fromkeys(specs, file))
            tensor_specs.update(specs)
    manifest = WeightsManifest(format_version=GGUF_FORMAT_VERSION if gguf else 1, name=name, num_layers=num_layers,
                               weights_sha256=digest, objects=objects, weight_map=weight_map, tensors=tensor_specs,
                               gguf=stored_gguf, objects_version=version)
    await store.put(object_key(name, MANIFEST_OBJECT), manifest.model_dump_json().encode())
    # Only now: a host may still be reading the previous manifest's objects (it is refused, and reads this one anew).
    await delete_objects_except(store, f"{name}/", {object_key(name, MANIFEST_OBJECT)} | {
        object_key(name, stored.file, version) for stored in objects})
    log.info("published %s: %d objects, weights %s", name, len(objects), digest[:12])
    return manifest


def _chunked(key: str):
    from nats.js.api import ObjectMeta, ObjectMetaOptions

    return ObjectMeta(name=key, options=ObjectMetaOptions(max_chunk_size=OBJECT_CHUNK_BYTES))


async def read_manifest(js, name: str) -> WeightsManifest:
    """The manifest of stored model `name`; WeightsStoreError when absent, oversized or malformed."""
    from nats.js.errors import ObjectNotFoundError
    from pydantic import ValidationError

    store = await _bucket(js, create=False)
    try:
        data = await read_small_object(store, object_key(name, MANIFEST_OBJECT), f"the manifest of {name!r}",
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


async def list_models(js) -> list[WeightsManifest]:
    """The manifests of every stored model, by name."""
    from nats.js.errors import NotFoundError

    store = await _bucket(js, create=False)
    try:
        infos = await store.list()
    except NotFoundError:  # an empty bucket
        return []
    names = sorted(info.name[:-len(MANIFEST_OBJECT) - 1] for info in infos  # not an object named manifest.json
                   if info.name.endswith("/" + MANIFEST_OBJECT) and info.name.count("/") == 1 and not info.deleted)
    return [await read_manifest(js, name) for name in names]


async def fetch_stored_model(js, name: str, needed: NeededTensors, *, cache_dir: Path | None = None) -> Path:
    """A loadable folder (for a GGUF: the GGUF file, NAME.gguf) holding what `needed` asks for of stored model `name`
    ((lo, hi), "head" or None for all): objects already cached and intact are kept, the others fetched and checked
    against the manifest's SHA-256."""
    needed = check_needed(needed)
    manifest = await read_manifest(js, check_model_name(name))
    if isinstance(needed, tuple) and needed[1] >= manifest.num_layers:
        raise WeightsStoreError(f"{name!r} has {manifest.num_layers} layers: no layer {needed[1]}")
    root = (cache_dir or hearth_cache_dir()) / STORE_CACHE_FOLDER / name / manifest.weights_sha256[:16]
    # Side files are no part of weights_sha256: they, and the folders linking them, are kept per manifest.
    published, gguf_name = root / manifest.digest()[:16], f"{name}{GGUF_SUFFIX}"
    target = published / selection_name(needed)
    if (done := complete_partial_folder(target)) is not None:
        return done / gguf_name if manifest.gguf else done
    wanted = manifest.needed_objects(needed)
    files = {stored.file: (published / "files" if stored.kind == "file" else root / "objects") / stored.file
             for stored in wanted}
    for folder in {file.parent for file in files.values()}:
        folder.mkdir(parents=True, exist_ok=True)
    missing = [stored for stored in wanted if not await asyncio.to_thread(object_intact, files[stored.file], stored)]
    store = await _bucket(js, create=False)
    with _progress(sum(stored.size for stored in missing), f"fetching {name}") as bar:
        for stored in missing:
            await fetch_object(store, object_key(name, stored.file, manifest.objects_version), name, stored,
                               files[stored.file].parent)
            bar.update(stored.size)
    if manifest.gguf is not None:
        return await asyncio.to_thread(_write_gguf, manifest, target, gguf_name, files)
    return await asyncio.to_thread(assemble_partial_folder, target, files, manifest.weight_map,
                                   weights_sha256=manifest.weights_sha256, source=f"{STORE_MODEL_PREFIX}{name}")


def _write_gguf(manifest: WeightsManifest, target: Path, gguf_name: str, files: dict[str, Path]) -> Path:
    from hearth.inference.errors import CheckpointError
    from hearth.inference.gguf_parts import write_gguf_folder

    try:
        return write_gguf_folder(target, gguf_name, GGUF_HEADER_OBJECT, manifest.gguf, files,
                                 weights_sha256=manifest.weights_sha256, source=f"{STORE_MODEL_PREFIX}{manifest.name}")
    except CheckpointError as error:
        raise WeightsStoreError(f"{manifest.name!r}: {error}") from None


async def resolve_model_source(model: str, needed: NeededTensors, *, nats_url: str | None, settings) -> Path:
    """The local folder for `model`: `store:NAME` fetched from the community's store (only what `needed` asks
    for), anything else through inference's resolve_model_path (a hub id downloads only what `needed` asks for)."""
    from hearth.inference import resolve_model_path
    from hearth.services.broker.connection import connect_nats

    name = store_model_name(model)
    if name is None:
        return await asyncio.to_thread(resolve_model_path, model, needed_layers=needed)
    nc = await connect_nats(nats_url, name=f"hearth weights {name}", settings=settings.nats)
    try:
        return await fetch_stored_model(nc.jetstream(), name, needed)
    finally:
        await nc.close()
