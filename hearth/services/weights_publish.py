"""What the steward writes into the community's weights bucket: a checkpoint published (its objects under keys of this
publication's own, the manifest last; nothing left of a publication stopped midway) within the bucket's bound
(hearth/services/broker/weights_bucket.py), and a model removed (hearth/services/weights_store.py says what is stored
and how it is fetched)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hearth.inference.partial_checkpoint import NON_WEIGHT_PATTERNS, layer_of, partial_source
from hearth.services.broker.permissions import WEIGHTS_BUCKET
from hearth.services.broker.weights_bucket import STORE_FULL_ERR_CODES, WeightsBucketError, ensure_weights_bucket, \
    shown_size
from hearth.services.weights_objects import WeightsStoreError, delete_objects, purge_object, \
    purge_unnamed_chunks, put_new_object, put_object_if_unchanged, stored_meta
from hearth.services.weights_store import GGUF_EVERY_LAYER_OBJECT, GGUF_FORMAT_VERSION, GGUF_HEAD_OBJECT, \
    GGUF_HEADER_OBJECT, GGUF_LAYER_OBJECT_FORMAT, HEAD_OBJECT, LAYER_OBJECT_FORMAT, MANIFEST_OBJECT, \
    OBJECT_CHUNK_BYTES, OBJECT_FILE_MAX_CHARS, OBJECT_FILE_PATTERN, StoredObject, TensorSpec, WeightsManifest, \
    check_model_name, object_key, open_bucket, progress_bar, read_manifest

log = logging.getLogger(__name__)

# Tries of the manifest switch when other publishers of the name switch it meanwhile.
MANIFEST_SWITCH_ATTEMPTS = 5
# Objects of a version no manifest names are deleted once that publication has stored nothing for this long: an
# interrupted publication's. Before that they may be another publisher's, still storing its objects (one object is a
# layer: minutes at most).
ABANDONED_PUBLICATION_AGE_S = 24 * 3600
# What the server counts for one stored message beyond its payload (its subject, headers and record), at most: a
# chunk's is under a hundred bytes, an object's meta message a few hundred.
STORED_MESSAGE_OVERHEAD_BYTES = 512
# How long a stopped publication may take to remove what it stored.
DISCARD_TIMEOUT_S = 30.0


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
    for side_file in [] if gguf else _side_files(path):  # refused here, not once the objects before it are stored
        if len(side_file.name) > OBJECT_FILE_MAX_CHARS or not re.fullmatch(OBJECT_FILE_PATTERN, side_file.name):
            raise WeightsStoreError(f"{side_file} cannot be published under its name (letters, digits, '_', '.' or "
                                    "'-'): rename or remove it")
    # A part hearth fetched states the whole checkpoint's digest: published, it would stand for all of it.
    if (source := partial_source(gguf.parent if gguf else path)) is not None:
        raise WeightsStoreError(f"{path} holds only part of a checkpoint (fetched by hearth from {source}): publish "
                                "the original")
    return gguf


async def publish_checkpoint(js, folder: Path, name: str, *, max_store_bytes: int | None = None) -> WeightsManifest:
    """Store the checkpoint `folder` (a safetensors folder, a GGUF file or a folder holding one) as `name`
    (replacing what was there), one layer in memory at a time, under keys of this publication's own; the manifest
    goes last, so a reader never sees a manifest naming objects not yet stored or since rewritten, and only then are
    the objects it does not name deleted.

    The bucket is first brought to `max_store_bytes` ([weights] max_store_mb; None: the bound the broker gave it),
    and a checkpoint it has no room for is refused before anything is stored. A publication stopped midway (the
    store filled meanwhile, an error, Ctrl-C) removes what it stored: nothing of it is left, and `name` stays as it
    was."""
    import secrets

    from pydantic import ValidationError

    from hearth.inference import read_config_dict, weights_sha256
    from hearth.inference.errors import CheckpointError

    check_model_name(name)
    gguf = await asyncio.to_thread(check_publishable, folder)
    side_files = [] if gguf else _side_files(folder)
    try:
        stored_gguf, num_layers, blobs = (await asyncio.to_thread(_gguf_blobs, gguf) if gguf else (
            None, int(read_config_dict(folder)["num_hidden_layers"]), _layer_blobs(folder)))
        layer_bytes = gguf.stat().st_size if gguf else sum(file.stat().st_size for file in folder.glob("*.safetensors"))
        payload_bytes = layer_bytes + sum(file.stat().st_size for file in side_files)
    except (CheckpointError, KeyError, ValueError, OSError) as error:
        raise _unpublishable(folder, error) from None
    # Objects: each layer's, the head's, a GGUF's header and every-layer tensors', each side file.
    needed = stored_bytes_estimate(payload_bytes, num_layers + 3 + len(side_files))
    store = await _bucket_with_room(js, name, needed, max_store_bytes)  # before hashing: a refusal comes at once
    try:
        digest = await asyncio.to_thread(weights_sha256, gguf or folder)
    except (CheckpointError, OSError) as error:
        raise _unpublishable(folder, error) from None
    objects: list[StoredObject] = []
    weight_map: dict[str, str] = {}
    tensor_specs: dict[str, TensorSpec] = {}
    version = secrets.token_hex(8)

    def stored_keys() -> set[str]:
        return {object_key(name, stored.file, version) for stored in objects}

    async def put(file: str, kind: str, layer: int | None, data: bytes) -> None:
        await put_new_object(js, object_key(name, file, version), data, OBJECT_CHUNK_BYTES)
        objects.append(StoredObject(file=file, kind=kind, layer=layer, size=len(data),
                                    sha256=hashlib.sha256(data).hexdigest()))
        bar.update(len(data))

    try:
        with progress_bar(layer_bytes, f"publishing {name}") as bar:
            for side_file in side_files:
                await put(side_file.name, "file", None, side_file.read_bytes())
            while (item := await asyncio.to_thread(next, blobs, None)) is not None:
                file, kind, layer, data, specs = item
                await put(file, kind, layer, data)
                weight_map.update(dict.fromkeys(specs, file))
                tensor_specs.update(specs)
    except BaseException as error:  # an error, or Ctrl-C cancelling the task: no manifest will name what it stored
        await _discard_publication(js, stored_keys())
        if _store_full(error):
            raise _filled(name, sum(stored.size for stored in objects), needed) from None
        raise
    try:
        manifest = WeightsManifest(format_version=GGUF_FORMAT_VERSION if gguf else 1, name=name,
                                   num_layers=num_layers, weights_sha256=digest, objects=objects,
                                   weight_map=weight_map, tensors=tensor_specs, gguf=stored_gguf,
                                   objects_version=version)
    except ValidationError as error:  # nothing names the objects stored
        await _discard_publication(js, stored_keys())
        raise WeightsStoreError(f"{folder} cannot be published: {error.errors()[0]['msg']}") from None
    kept = {object_key(name, MANIFEST_OBJECT)} | stored_keys()
    try:
        replaced = await _switch_manifest(js, name, manifest)
    except BaseException as error:
        # Refused, or no room for it: no manifest names them (after another error the server may have stored it).
        if isinstance(error, WeightsStoreError) or _store_full(error):
            await _discard_publication(js, stored_keys())
        if _store_full(error):
            raise _filled(name, sum(stored.size for stored in objects), needed) from None
        raise
    # Only now, and only the objects of the manifest this switch replaced: a host may still be reading them (it is
    # refused, and reads this one anew), and another publisher's objects, stored or being stored, are its own.
    if replaced is not None:
        await delete_objects(store, {object_key(name, stored.file, replaced.objects_version)
                                     for stored in replaced.objects} - kept)
    await _delete_abandoned(js, store, name, kept)
    log.info("published %s: %d objects, weights %s", name, len(objects), digest[:12])
    return manifest


def _store_full(error: BaseException) -> bool:
    return getattr(error, "err_code", None) in STORE_FULL_ERR_CODES


def _filled(name: str, stored_bytes: int, needed: int) -> WeightsStoreError:
    return WeightsStoreError(
        f"the weights store filled while {name!r} was published ({shown_size(stored_bytes)} of about "
        f"{shown_size(needed)} stored: another publication, or the broker's store as a whole, took the room "
        f"meanwhile): what it stored is removed and {name!r} is as it was")


def _unpublishable(folder: Path, error: Exception) -> WeightsStoreError:
    return WeightsStoreError(f"{folder} is not a checkpoint hearth can publish: {error}")


def stored_bytes_estimate(payload_bytes: int, objects: int) -> int:
    """What storing `payload_bytes` in at most `objects` objects (and a manifest) takes in the bucket, as the server
    counts it: each object's chunks (one partly filled at most) and meta message, each with its subject and headers."""
    messages = payload_bytes // OBJECT_CHUNK_BYTES + 2 * (objects + 1)
    return payload_bytes + messages * STORED_MESSAGE_OVERHEAD_BYTES


async def _bucket_with_room(js, name: str, needed: int, max_store_bytes: int | None):
    """The bucket, brought to its bound, once it has room for `needed` bytes more; WeightsStoreError (one line, the
    sizes and the room said) otherwise. A republish needs room for both publications: the one it replaces goes once
    its manifest is switched."""
    try:
        room = await ensure_weights_bucket(js, max_store_bytes)
    except WeightsBucketError as error:
        raise WeightsStoreError(str(error)) from None
    if needed > room.free:
        raise WeightsStoreError(
            f"{name!r} needs about {shown_size(needed)} in the weights store, which has {shown_size(room.free)} free "
            f"of its {shown_size(room.bound)}: `hearth weights list` shows what it holds, `hearth weights remove NAME` "
            "frees a model's room")
    return await js.object_store(WEIGHTS_BUCKET)


async def _discard_publication(js, keys: set[str]) -> None:
    """Purge the objects `keys` of a publication no manifest names, within DISCARD_TIMEOUT_S; what cannot be is
    said and left to the next publication of the name (_delete_abandoned)."""
    try:
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            for key in sorted(keys):
                await purge_object(js, key)
    except Exception as error:  # the error that stopped the publication is the one to raise
        log.warning("the %d objects this publication stored could not all be removed (%s): the next publication "
                    "of its name removes them a day on", len(keys), f"{type(error).__name__}: {error}")


@dataclass(frozen=True)
class RemovedModel:
    """What `remove_model` removed: objects and their bytes, and the objects it left to a publication under way."""

    objects: int
    size: int
    left_under_way: int


async def remove_model(js, name: str) -> RemovedModel:
    """Remove stored model `name`: its manifest first (no host starts fetching it afterwards), then every object
    stored under its name (an interrupted publication's too, a tombstone too), leaving nothing of them in the bucket,
    but the objects of a publication under way: those of a version no manifest names whose publication stored one
    within ABANDONED_PUBLICATION_AGE_S. Removing them would leave the manifest it switches to naming objects that are
    gone; it ends publishing the name again, or the next publication of the name removes them once they are that
    old. WeightsStoreError when the store holds nothing under that name, or only a publication under way. Hosts
    serving the model from their cache go on."""
    from nats.js.errors import NotFoundError

    check_model_name(name)
    store = await open_bucket(js)
    try:
        infos = [info for info in await store.list(ignore_deletes=False) if info.name.startswith(f"{name}/")]
    except NotFoundError:  # an empty bucket
        infos = []
    present = [info for info in infos if not info.deleted]
    if not present:
        raise WeightsStoreError(f"no model {name!r} in the community's store (`hearth weights list`)")
    try:
        named_version = (await read_manifest(js, name)).objects_version
    except WeightsStoreError:  # none, or unreadable: every version is judged by its age
        named_version = None
    # Ages against this host's clock: a publication under way stored an object minutes ago, a day is the bound.
    under_way = await _publications_under_way(js, name, [info.name for info in present], named_version,
                                              datetime.now(timezone.utc))
    if len(under_way) == len(present):
        raise WeightsStoreError(f"{name!r} is being published (its {len(present)} objects were stored within "
                                f"{ABANDONED_PUBLICATION_AGE_S // 3600} h and no manifest names them yet): remove it "
                                "once that publication ends")
    manifest_key = object_key(name, MANIFEST_OBJECT)
    removed = [info for info in infos if info.name not in under_way]
    for info in sorted(removed, key=lambda info: (info.name != manifest_key, info.name)):
        await purge_object(js, info.name)  # a deleted object's tombstone too
    gone = [info for info in removed if not info.deleted]
    log.info("removed %s: %d objects (%d left to a publication under way)", name, len(gone), len(under_way))
    return RemovedModel(len(gone), sum(info.size or 0 for info in gone), len(under_way))


async def _publications_under_way(js, name: str, keys: list[str], named_version: str | None,
                                  now: datetime) -> set[str]:
    """The keys among `keys` of publications of `name` that no manifest names (not `named_version`'s) and that
    stored an object, by the server's clock, within ABANDONED_PUBLICATION_AGE_S before `now`."""
    publications: dict[str, list[str]] = {}
    for key in keys:  # NAME/VERSION/FILE; NAME/FILE is the manifest, or stored before publications had versions
        prefix = key.rsplit("/", 1)[0]
        if prefix not in (name, f"{name}/{named_version}"):
            publications.setdefault(prefix, []).append(key)
    under_way: set[str] = set()
    for publication_keys in publications.values():
        stored = [(await stored_meta(js, key)).stored_at for key in publication_keys]
        if any(at is not None and (now - at).total_seconds() < ABANDONED_PUBLICATION_AGE_S for at in stored):
            under_way.update(publication_keys)
    return under_way


async def _switch_manifest(js, name: str, manifest: WeightsManifest) -> WeightsManifest | None:
    """Make `manifest` the stored manifest of `name`; the one it replaced (None: none, or unreadable). A switch that
    raced another publisher's is refused by the server and tried again on the newer one."""
    key, data = object_key(name, MANIFEST_OBJECT), manifest.model_dump_json().encode()
    for _ in range(MANIFEST_SWITCH_ATTEMPTS):
        seen = await stored_meta(js, key)
        try:  # read after its meta message: a switch in between makes the put below refused
            replaced = await read_manifest(js, name)
        except WeightsStoreError:
            replaced = None
        if await put_object_if_unchanged(js, key, data, seen, OBJECT_CHUNK_BYTES):
            return replaced
    raise WeightsStoreError(f"the manifest of {name!r} was replaced by other publishers {MANIFEST_SWITCH_ATTEMPTS} "
                            "times while this publication tried to switch it: publish again")


async def _delete_abandoned(js, store, name: str, kept: set[str]) -> None:
    """Delete the objects of `name` outside `kept` whose publication (their key's version) stored nothing for
    ABANDONED_PUBLICATION_AGE_S: an interrupted publication's. A younger one may be another publisher's at work.

    So are the chunks no object names, whatever name they were stored for (purge_unnamed_chunks). Ages are the
    server's: when it stored each object's info, against when it stored this publication's manifest
    switch. The info's mtime is the writer's own clock: a publisher's clock running behind would have its upload
    deleted by another publisher while still under way, one running ahead would keep its junk for as long."""
    from nats.js.errors import NotFoundError

    try:
        every_info = await store.list(ignore_deletes=False)
    except NotFoundError:  # an empty bucket
        return
    infos = [info for info in every_info
             if info.name.startswith(f"{name}/") and info.name not in kept and not info.deleted]
    now = (await stored_meta(js, object_key(name, MANIFEST_OBJECT))).stored_at
    if now is None:  # no manifest stored (deleted meanwhile): nothing to measure ages against
        return
    # The chunks of an object whose publisher was killed before its meta message: no key names them, whatever name.
    await purge_unnamed_chunks(js, {info.nuid for info in every_info if info.nuid},
                               now - timedelta(seconds=ABANDONED_PUBLICATION_AGE_S))
    publications: dict[str, list[str]] = {}
    for info in infos:  # NAME/VERSION/FILE, or NAME/FILE stored before publications had versions
        publications.setdefault(info.name.rsplit("/", 1)[0], []).append(info.name)
    for keys in publications.values():
        stored = [(await stored_meta(js, key)).stored_at for key in keys]
        if all(at is not None and (now - at).total_seconds() >= ABANDONED_PUBLICATION_AGE_S for at in stored):
            await delete_objects(store, set(keys))
