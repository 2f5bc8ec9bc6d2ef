"""Downloading from the hub only the files a layer range (or the head) needs, into a partial checkpoint folder.

The repository's file listing (sizes and each LFS file's SHA-256) and its ``model.safetensors.index.json`` say which
safetensors files hold the wanted tensors; only those, plus config, tokenizer and chat template files, are
downloaded (never past the size the listing states: hearth/inference/hub_download.py), into hearth's cache rather
than the hub snapshot cache, whose snapshot folders must stay complete for ``snapshot_download`` users. Each
downloaded weight file is checked
against its listed SHA-256, and the folder states the whole checkpoint's digest computed from the listing, so
shard hosts holding different ranges of one repository form one pipeline (hearth/inference/partial_checkpoint.py).

Before downloading any weight, `hearth host` sizes its range from `hub_layout`: config.json, each tensor's dtype and
shape read from the safetensors files' headers (ranged reads, huggingface_hub's parse_safetensors_file_metadata) and
the digest from the listing.

A GGUF is served from a repository holding no safetensors weights but one GGUF file, or from the file an id of the
form ``owner/name:FILE.gguf`` names (a repository of several GGUFs, Q4_K_M and Q8_0 side by side, serves any of
them; a plain id of such a repository is refused naming them, since which one to serve would be a guess). A host
reads only its range of it: the header by HTTP byte ranges, then only its tensors' bytes, written as a partial GGUF
stating the whole file's digest (hearth/inference/hub_gguf.py, which also says what is trusted); `hub_layout` sizes a
range from the header alone. The whole model (an orchestrator's local fallback), or a server that does not answer byte
ranges, downloads the file whole (resumable, with progress, checked against its listed SHA-256), and a whole file
downloaded for a commit then serves every range.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_files import SAFETENSORS_INDEX_NAME, check_full_precision, checked_weight_map
from .cache_ranges import held_complete_folder, hold_range, remove_superseded_ranges
from .cache_versions import hold_version, is_held, release_version, remove_unused_versions
from .checksum import GGUF_DIGEST_NAME, PARTIAL_CHECKPOINT_MARKER, digest_of_files, file_sha256
from hearth.formats.cache_layout import HUB_PARTIAL_FOLDER, hearth_cache_dir
from hearth.formats.gguf_support import GGUF_SUFFIX
from .errors import CheckpointError
from .hub_cache import complete_hub_snapshot, hub_cache_gguf
from .hub_gguf import HubGGUF, RangesUnsupported, cached_gguf_part, fetch_gguf_part, gguf_header, \
    gguf_metadata_file, layer_tensor_shapes_of, remove_part_leftovers
from .hub_download import download_listed_file
from .hub_ids import HUB_ENDPOINT_ENV, split_hub_model
from .partial_checkpoint import (
    NON_WEIGHT_PATTERNS,
    NeededTensors,
    assemble_partial_folder,
    check_needed,
    complete_partial_folder,
    files_holding,
    selection_name,
    written_marker,
)

logger = logging.getLogger(__name__)

# Where a repository's GGUF FILE is downloaded whole, per commit: <commit>/gguf-files/FILE/ holds the file and,
# once checked, the marker stating its digest; its ranged parts live in <commit>/gguf-parts/FILE/.
HUB_GGUF_FOLDER = "gguf-files"
HUB_GGUF_PARTS_FOLDER = "gguf-parts"
# Names the GGUF a plain id of a one-GGUF repository resolved to at that commit, so it resolves offline too.
HUB_DEFAULT_GGUF_FILE = "gguf-default"
DEFAULT_REVISION = "main"
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
# Beyond these a repository's files besides its weights (config, tokenizer, index, ...) are no model's: refused
# before any is downloaded.
MAX_SIDE_FILES = 64
MAX_SIDE_FILE_BYTES = 256 << 20
# Beyond this many entries (files and folders, at any depth) a repository's listing is no model's: read no further.
MAX_LISTED_ENTRIES = 10_000
HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"


def hub_downloads_disabled() -> bool:
    """Whether HF_HUB_OFFLINE forbids fetching from the hub (then only what is cached is used)."""
    return os.environ.get(HUB_OFFLINE_ENV, "0").lower() in ("1", "true", "yes")


def hub_partial_root(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """Where partial copies of `repo_id` live: <cache_dir or hearth's cache>/hearth-partial/<org>--<name>."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else hearth_cache_dir()
    return base / HUB_PARTIAL_FOLDER / repo_id.replace("/", "--")


def fetch_hub_selection(model: str, needed: NeededTensors, *, revision: str | None = None,
                        cache_dir: str | Path | None = None, local_files_only: bool | None = False) -> Path:
    """A loadable folder (or GGUF file) holding what `needed` asks for of hub model `model` ("owner/name" or
    "owner/name:FILE.gguf") at `revision`.

    A complete snapshot in the hub cache, or a folder assembled earlier for the same revision and selection, is
    used without any network; otherwise,
    unless `local_files_only` (None: as HF_HUB_OFFLINE says), the listing, the index and the needed files are
    downloaded. CheckpointError (one line) when the repository, a file or a checksum is wrong or unreachable."""
    if local_files_only is None:
        local_files_only = hub_downloads_disabled()
    needed = check_needed(needed)
    repo_id, gguf_file = split_hub_model(model)
    if gguf_file is None and (whole := complete_hub_snapshot(repo_id, revision, cache_dir)) is not None:
        return whole
    if (downloaded := hub_cache_gguf(model, revision, cache_dir)) is not None:
        return downloaded  # whole, so it serves any range
    root = hub_partial_root(repo_id, cache_dir)
    ref_file = root / "refs" / (revision or DEFAULT_REVISION)
    if ref_file.is_file() and is_commit_hash(commit := ref_file.read_text().strip()):
        held_before = is_held(root / commit)
        commit_dir = hold_version(root, root / commit)  # before it is read: no cleaning process removes it then
        if (gguf := _cached_gguf(commit_dir, gguf_file, needed)) is not None:
            return gguf
        cached = None if gguf_file else held_complete_folder(commit_dir, commit_dir / selection_name(needed))
        if cached is not None:
            return cached
        if not held_before:  # nothing of it used: the download below may be of a newer commit
            release_version(commit_dir)
    if local_files_only:
        raise CheckpointError(f"model {model!r}: the {selection_name(needed)} part is not in {root} "
                              "(and downloads are disabled)")
    try:
        return _download_selection(repo_id, gguf_file, needed, revision, root)
    except CheckpointError:
        raise
    except Exception as exc:  # the hub client raises many network error types; all mean "not available"
        raise CheckpointError(f"model {model!r} is not fetchable from the hub: {exc}") from exc


@dataclass(frozen=True)
class HubLayout:
    """What a host sizes a layer range from, with no weight downloaded: the repository's config.json, each
    tensor's (name, stored type: a safetensors dtype or a GGUF block type, shape) and the whole checkpoint's digest
    (as its partial folders state it)."""

    config: dict
    tensors: list[tuple[str, str, list[int]]]
    weights_sha256: str


def hub_layout(model: str, *, revision: str | None = None, cache_dir: str | Path | None = None,
               local_files_only: bool | None = None) -> HubLayout:
    """The HubLayout of hub model `model` at `revision`: the listing, config.json and each safetensors file's header
    only (a GGUF's header only, read by byte ranges).
    CheckpointError (one line) when it is unreachable, downloads are disabled (`local_files_only`, None: as
    HF_HUB_OFFLINE says), or it is not a safetensors model."""
    if local_files_only is None:
        local_files_only = hub_downloads_disabled()
    repo_id, gguf_file = split_hub_model(model)
    if local_files_only:
        raise CheckpointError(f"model {model!r} is not in the local hub cache (and downloads are disabled)")
    try:
        api, commit, listing, weights = _repository(repo_id, revision)
        hold_version(root := hub_partial_root(repo_id, cache_dir), root / commit)
        if gguf_file is not None or not weights:
            return _gguf_hub_layout(_hub_gguf(repo_id, commit, listing, gguf_file, root), listing)
        config = json.loads(_downloader(repo_id, commit, root, listing)("config.json").read_text())
        check_full_precision(config, repo_id)
        tensors = [(name, info.dtype, list(info.shape))
                   for file in sorted(weights)
                   for name, info in api.parse_safetensors_file_metadata(repo_id, file, revision=commit)
                   .tensors.items()]
    except CheckpointError:
        raise
    except Exception as exc:  # the hub client raises many network error types; all mean "not available"
        raise CheckpointError(f"model {model!r} is not readable from the hub: {exc}") from exc
    return HubLayout(config=config, tensors=tensors, weights_sha256=digest_of_files(_listed_hashes(weights, {})))


def _repository(repo_id: str, revision: str | None):
    """(HfApi, commit, top-level files by name, safetensors files by name) of `repo_id` at `revision`."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None)
    commit = api.repo_info(repo_id, revision=revision).sha
    if not is_commit_hash(commit):  # it names folders of the cache: the hub's word alone must not choose them
        raise CheckpointError(f"model {repo_id!r}: the hub answered {commit!r} as its commit, not a commit hash")
    listing = {}
    for count, entry in enumerate(api.list_repo_tree(repo_id, recursive=True, revision=commit)):
        if count == MAX_LISTED_ENTRIES:  # a listing paged without end would be held in memory whole
            raise CheckpointError(f"model {repo_id!r} lists more than {MAX_LISTED_ENTRIES} files: not a model "
                                  "hearth downloads")
        if isinstance(entry, RepoFile) and "/" not in entry.path:
            listing[entry.path] = entry
    weights = {name: entry for name, entry in listing.items() if name.endswith(".safetensors")}
    if not weights and not any(name.lower().endswith(GGUF_SUFFIX) for name in listing):
        raise CheckpointError(f"model {repo_id!r} has no safetensors or GGUF weights on the hub")
    return api, commit, listing, weights


def _downloader(repo_id: str, commit: str, root: Path, listing: dict):
    """A function downloading one file of `repo_id` at `commit` into `root`'s folder of that commit, never more bytes
    than `listing` states for it (hearth/inference/hub_download.py)."""
    files_dir = root / commit / "files"

    def download(name: str) -> Path:
        if name not in listing:
            raise CheckpointError(f"model {repo_id!r} lists no {name}")
        return download_listed_file(repo_id, commit, listing[name], files_dir)
    return download


def _download_selection(repo_id: str, gguf_file: str | None, needed: NeededTensors, revision: str | None,
                        root: Path) -> Path:
    _, commit, listing, weights = _repository(repo_id, revision)
    hold_version(root, root / commit)
    if gguf_file is not None or not weights:
        hub = _hub_gguf(repo_id, commit, listing, gguf_file, root)
        path = _fetch_gguf(hub, listing, needed)
        if gguf_file is None:
            (root / commit / HUB_DEFAULT_GGUF_FILE).write_text(hub.file)
        _write_ref(root, revision, commit)
        return path
    download = _downloader(repo_id, commit, root, listing)
    # The files besides the weights (the index among them). A listed marker of hearth's own is no file of the model:
    # the folder's marker states the digest computed here.
    side_files = [name for name in listing if name not in weights and name != PARTIAL_CHECKPOINT_MARKER
                  and any(fnmatch.fnmatch(name, pattern) for pattern in NON_WEIGHT_PATTERNS)]
    oversized = [name for name in side_files if (listing[name].size or 0) > MAX_SIDE_FILE_BYTES]
    if len(side_files) > MAX_SIDE_FILES or oversized:
        raise CheckpointError(f"model {repo_id!r} lists {len(side_files)} files besides its weights"
                              + (f", {oversized[0]} over {MAX_SIDE_FILE_BYTES} bytes" if oversized else
                                 f" (more than {MAX_SIDE_FILES})") + ": not a model hearth downloads")

    weight_map = None
    if SAFETENSORS_INDEX_NAME in listing:
        index = download(SAFETENSORS_INDEX_NAME)
        weight_map = checked_weight_map(json.loads(index.read_text()).get("weight_map"), index)
        wanted_weights = files_holding(weight_map, needed)
    else:
        wanted_weights = set(weights)
    unlisted = sorted(wanted_weights - set(weights))
    if unlisted:
        raise CheckpointError(f"model {repo_id!r}: its index names {unlisted[0]}, which the repository lacks")
    others = [name for name in side_files if name != SAFETENSORS_INDEX_NAME]
    target = root / commit / selection_name(needed)
    hold_range(root / commit, target)  # before its files are fetched: a cleaning process keeps them
    fetched = {name: download(name) for name in sorted(others)}
    for name in sorted(wanted_weights):
        fetched[name] = download(name)
        expected = weights[name].lfs.sha256 if weights[name].lfs is not None else None
        if expected is not None and file_sha256(fetched[name]) != expected:
            fetched[name].unlink(missing_ok=True)  # else the next try would take it as done
            raise CheckpointError(f"model {repo_id!r}: {name} does not match its listed SHA-256 "
                                  "(corrupted download or tampered mirror)")
    digest = digest_of_files(_listed_hashes(weights, fetched))
    folder = assemble_partial_folder(target, fetched, weight_map, weights_sha256=digest,
                                     source=f"hub:{repo_id}@{commit}")
    _write_ref(root, revision, commit)
    # The commit's other ranges no process uses, and the weight files only they needed (cache_ranges.py).
    remove_superseded_ranges(root / commit, [root / commit], root / commit / "files",
                             lambda selected: set() if weight_map is None else files_holding(weight_map, selected),
                             written=target.name)
    return folder


def is_commit_hash(text: object) -> bool:
    """Whether `text` is a commit hash as the hub states them (40 lowercase hexadecimal digits)."""
    return isinstance(text, str) and COMMIT_HASH.fullmatch(text) is not None


def _write_ref(root: Path, revision: str | None, commit: str) -> None:
    """Point the revision at `commit`, whose folder now holds a complete part, and remove the folders of commits no
    revision points at any more that no process uses (hearth/inference/cache_versions.py)."""
    ref_file = root / "refs" / (revision or DEFAULT_REVISION)
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(commit)
    refs = [ref.read_text().strip() for ref in (root / "refs").rglob("*") if ref.is_file()]  # a tag may hold a "/"
    remove_unused_versions(root, {root / "refs"} | {root / ref for ref in refs if is_commit_hash(ref)})


def _cached_gguf(commit_dir: Path, file: str | None, needed: NeededTensors) -> Path | None:
    """The GGUF `file` (None: the one a plain id resolved to) downloaded whole for that commit, else its part for
    `needed` fetched earlier; None when neither is there."""
    if file is None:
        default = commit_dir / HUB_DEFAULT_GGUF_FILE
        if not default.is_file():
            return None
        file = default.read_text().strip()
    if (whole := _complete_gguf(commit_dir, file)) is not None:
        return whole
    if needed is None:
        return None
    parts = commit_dir / HUB_GGUF_PARTS_FOLDER / file
    return cached_gguf_part(parts, file, needed) if held_complete_folder(parts, parts / selection_name(needed)) \
        else None


def _complete_gguf(commit_dir: Path, file: str) -> Path | None:
    """The GGUF `file` downloaded whole and checked earlier for that commit, None when it is not; when it is, its
    ranged parts no process holds are removed (the whole file serves every range, so none is built again)."""
    if (folder := complete_partial_folder(commit_dir / HUB_GGUF_FOLDER / file)) is None:
        return None
    remove_part_leftovers(commit_dir / HUB_GGUF_PARTS_FOLDER / file, None, None)
    return folder / file


def _hub_gguf(repo_id: str, commit: str, listing: dict, file: str | None, root: Path) -> HubGGUF:
    """The GGUF `file` of the repository (None: its only one); CheckpointError (one line, listing what the
    repository holds) when it holds no such file, or several GGUFs and none is named."""
    found = sorted(name for name in listing if name.lower().endswith(GGUF_SUFFIX))
    if file is None:
        if len(found) > 1:
            raise CheckpointError(f"model {repo_id!r} holds several GGUF files ({', '.join(found)}) and no "
                                  f"safetensors weights: name the one to serve, as {repo_id}:{found[0]}")
        file = found[0]
    elif file not in listing:
        held = f"the GGUF files {', '.join(found)}" if found else f"no GGUF file ({', '.join(sorted(listing))})"
        raise CheckpointError(f"model {repo_id!r} has no file {file}: the repository holds {held}")
    entry = listing[file]
    size = entry.lfs.size if entry.lfs is not None else entry.size
    sha256 = entry.lfs.sha256 if entry.lfs is not None else ""
    return HubGGUF(repo_id, file, commit, size, sha256, root / commit / HUB_GGUF_PARTS_FOLDER / file)


def _fetch_gguf(hub: HubGGUF, listing: dict, needed: NeededTensors) -> Path:
    """What `needed` asks for of `hub`'s file: the file itself once downloaded whole (and for the whole model, or
    when ranges are not served or no SHA-256 is listed), else its ranged part."""
    if (whole := _complete_gguf(hub.folder.parent.parent, hub.file)) is not None:
        return whole
    if needed is not None and hub.sha256:
        try:
            hold_range(hub.folder, hub.folder / selection_name(needed))
            part = fetch_gguf_part(hub, needed)
            remove_part_leftovers(hub.folder, gguf_header(hub)[0], needed)
            return part
        except RangesUnsupported as unsupported:
            logger.warning("%s; downloading %s whole", unsupported, hub.file)
    return _download_gguf(hub, listing)


def _download_gguf(hub: HubGGUF, listing: dict) -> Path:
    """`hub`'s GGUF file, downloaded (or resumed) whole and checked against its listed SHA-256, in a folder whose
    marker states its digest (so no host hashes it again)."""
    commit_dir = hub.folder.parent.parent
    if (done := _complete_gguf(commit_dir, hub.file)) is not None:
        return done
    entry, folder = listing[hub.file], commit_dir / HUB_GGUF_FOLDER / hub.file
    path = download_listed_file(hub.repo_id, hub.commit, entry, folder)
    size, digest = path.stat().st_size, file_sha256(path)
    if entry.lfs is not None and entry.lfs.sha256 != digest:  # its size was checked against the listing as it came
        path.unlink()
        raise CheckpointError(f"model {hub.repo_id!r}: {hub.file} does not match its listed SHA-256 (corrupted "
                              "download or tampered mirror)")
    written_marker(folder, weights_sha256=digest_of_files([(GGUF_DIGEST_NAME, size, digest)]), source=hub.source)
    return _complete_gguf(commit_dir, hub.file) or path  # the parts built before it removed there


def _gguf_hub_layout(hub: HubGGUF, listing: dict) -> HubLayout:
    """The HubLayout of `hub`'s file: from the file when downloaded whole (or it must be), else from its header
    alone, read by byte ranges."""
    if (whole := _complete_gguf(hub.folder.parent.parent, hub.file)) is None and hub.sha256:
        from .gguf_checkpoint import gguf_config_dict

        try:
            parsed, header = gguf_header(hub)
            return HubLayout(config=gguf_config_dict(gguf_metadata_file(hub, parsed, header)),
                             tensors=layer_tensor_shapes_of(parsed),
                             weights_sha256=hub.weights_sha256)
        except RangesUnsupported as unsupported:
            logger.warning("%s; downloading %s whole", unsupported, hub.file)
    return _gguf_layout(whole or _download_gguf(hub, listing))


def _gguf_layout(path: Path) -> HubLayout:
    """The HubLayout of a downloaded GGUF: each layer tensor with its block type, as the loader holds it
    (hearth/inference/memory.py)."""
    from .checksum import weights_sha256
    from .gguf_checkpoint import gguf_config_dict
    from .gguf_tensor_table import gguf_layer_tensors, layer_tensor_blocks

    return HubLayout(config=gguf_config_dict(path), tensors=gguf_layer_tensors(layer_tensor_blocks(path)),
                     weights_sha256=weights_sha256(path))


def _listed_hashes(weights: dict, fetched: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(name, size, sha256) of every weight file: from the listing for LFS files, else hashed here when fetched."""
    entries = []
    for name, entry in weights.items():
        if entry.lfs is not None:
            entries.append((name, entry.lfs.size, entry.lfs.sha256))
        elif name in fetched:
            entries.append((name, fetched[name].stat().st_size, file_sha256(fetched[name])))
        else:
            raise CheckpointError(f"{name} is stored without LFS, so the hub lists no SHA-256 for it: "
                                  "fetch the whole checkpoint instead")
    return entries
