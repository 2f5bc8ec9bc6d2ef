"""Downloading from the hub only the files a layer range (or the head) needs, into a partial checkpoint folder.

The repository's file listing (sizes and each LFS file's SHA-256) and its ``model.safetensors.index.json`` say which
safetensors files hold the wanted tensors; only those, plus config, tokenizer and chat template files, are
downloaded (huggingface_hub's ``hf_hub_download``, into hearth's cache rather than the hub snapshot cache, whose
snapshot folders must stay complete for ``snapshot_download`` users). Each downloaded weight file is checked
against its listed SHA-256, and the folder states the whole checkpoint's digest computed from the listing, so
shard hosts holding different ranges of one repository form one pipeline (inference/partial_checkpoint.py).

Before downloading any weight, `hearth host` sizes its range from `hub_layout`: config.json, each tensor's dtype and
shape read from the safetensors files' headers (ranged reads, huggingface_hub's parse_safetensors_file_metadata) and
the digest from the listing.

A repository holding no safetensors weights but one GGUF file is served from that file, as a folder holding one GGUF
is: every host downloads it whole (resumable, with progress, checked against its listed SHA-256) and reads its range
from it (inference/gguf_checkpoint.py); `hub_layout` sizes ranges from the downloaded file. A repository holding
several GGUFs is refused, naming them, as such a folder is: which one to serve would be a guess.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_files import SAFETENSORS_INDEX_NAME
from .checksum import GGUF_DIGEST_NAME, GGUF_SUFFIX, PARTIAL_CHECKPOINT_MARKER, digest_of_files, file_sha256
from .errors import CheckpointError
from .partial_checkpoint import (
    NON_WEIGHT_PATTERNS,
    NeededTensors,
    assemble_partial_folder,
    check_needed,
    complete_partial_folder,
    files_holding,
    hearth_cache_dir,
    selection_name,
)

HUB_PARTIAL_FOLDER = "hearth-partial"
# Where a repository's GGUF is downloaded, per commit: the file and, once checked, the marker stating its digest.
HUB_GGUF_FOLDER = "gguf"
DEFAULT_REVISION = "main"
# Read at each call (huggingface_hub reads it once, at import): a mirror or a test server may be named later.
HUB_ENDPOINT_ENV = "HF_ENDPOINT"
HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"


def hub_partial_root(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """Where partial copies of `repo_id` live: <cache_dir or hearth's cache>/hearth-partial/<org>--<name>."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else hearth_cache_dir()
    return base / HUB_PARTIAL_FOLDER / repo_id.replace("/", "--")


def fetch_hub_selection(repo_id: str, needed: NeededTensors, *, revision: str | None = None,
                        cache_dir: str | Path | None = None, local_files_only: bool = False) -> Path:
    """A loadable folder holding what `needed` asks for of hub repository `repo_id` at `revision`.

    A complete snapshot in the hub cache, or a folder assembled earlier for the same revision and selection, is
    used without any network; otherwise,
    unless `local_files_only`, the listing, the index and the needed files are downloaded. CheckpointError
    (one line) when the repository, a file or a checksum is wrong or unreachable."""
    needed = check_needed(needed)
    if (whole := complete_hub_snapshot(repo_id, revision, cache_dir)) is not None:
        return whole
    root = hub_partial_root(repo_id, cache_dir)
    ref_file = root / "refs" / (revision or DEFAULT_REVISION)
    if ref_file.is_file():
        commit_dir = root / ref_file.read_text().strip()
        if (gguf := _complete_gguf(commit_dir)) is not None:
            return gguf
        cached = complete_partial_folder(commit_dir / selection_name(needed))
        if cached is not None:
            return cached
    if local_files_only:
        raise CheckpointError(f"model {repo_id!r}: the {selection_name(needed)} part is not in {root} "
                              "(and downloads are disabled)")
    try:
        return _download_selection(repo_id, needed, revision, root)
    except CheckpointError:
        raise
    except Exception as exc:  # the hub client raises many network error types; all mean "not available"
        raise CheckpointError(f"model {repo_id!r} is not fetchable from the hub: {exc}") from exc


def complete_hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | Path | None) -> Path | None:
    """The hub snapshot cache's folder of `repo_id` when it already holds every weight file its index names."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
        index = folder / SAFETENSORS_INDEX_NAME
        names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    except Exception:  # absent, or an unreadable index: not usable as it is
        return None
    complete = (folder / "config.json").is_file() and all((folder / name).is_file() for name in names)
    return folder if complete and (names or any(folder.glob("*.safetensors"))) else None


@dataclass(frozen=True)
class HubLayout:
    """What a host sizes a layer range from, with no weight downloaded: the repository's config.json, each
    tensor's (name, safetensors dtype, shape) and the whole checkpoint's digest (as its partial folders state it)."""

    config: dict
    tensors: list[tuple[str, str, list[int]]]
    weights_sha256: str


def hub_layout(repo_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None,
               local_files_only: bool | None = None) -> HubLayout:
    """The HubLayout of `repo_id` at `revision`: the listing, config.json and each safetensors file's header only.
    CheckpointError (one line) when it is unreachable, downloads are disabled (`local_files_only`, None: as
    HF_HUB_OFFLINE says), or it is not a safetensors model."""
    if local_files_only is None:
        local_files_only = os.environ.get(HUB_OFFLINE_ENV, "0").lower() in ("1", "true", "yes")
    if local_files_only:
        raise CheckpointError(f"model {repo_id!r} is not in the local hub cache (and downloads are disabled)")
    try:
        api, commit, listing, weights = _repository(repo_id, revision)
        if not weights:
            root = hub_partial_root(repo_id, cache_dir)
            return _gguf_layout(_download_gguf(repo_id, revision, commit, listing, root))
        config = json.loads(_downloader(repo_id, commit, hub_partial_root(repo_id, cache_dir))("config.json")
                            .read_text())
        tensors = [(name, info.dtype, list(info.shape))
                   for file in sorted(weights)
                   for name, info in api.parse_safetensors_file_metadata(repo_id, file, revision=commit)
                   .tensors.items()]
    except CheckpointError:
        raise
    except Exception as exc:  # the hub client raises many network error types; all mean "not available"
        raise CheckpointError(f"model {repo_id!r} is not readable from the hub: {exc}") from exc
    return HubLayout(config=config, tensors=tensors, weights_sha256=digest_of_files(_listed_hashes(weights, {})))


def _repository(repo_id: str, revision: str | None):
    """(HfApi, commit, top-level files by name, safetensors files by name) of `repo_id` at `revision`."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None)
    commit = api.repo_info(repo_id, revision=revision).sha
    listing = {entry.path: entry for entry in api.list_repo_tree(repo_id, recursive=True, revision=commit)
               if isinstance(entry, RepoFile) and "/" not in entry.path}
    weights = {name: entry for name, entry in listing.items() if name.endswith(".safetensors")}
    if not weights and not any(name.lower().endswith(GGUF_SUFFIX) for name in listing):
        raise CheckpointError(f"model {repo_id!r} has no safetensors or GGUF weights on the hub")
    return api, commit, listing, weights


def _downloader(repo_id: str, commit: str, root: Path):
    """A function downloading one file of `repo_id` at `commit` into `root`'s folder of that commit."""
    from huggingface_hub import hf_hub_download

    endpoint = os.environ.get(HUB_ENDPOINT_ENV) or None
    files_dir = root / commit / "files"

    def download(name: str) -> Path:
        return Path(hf_hub_download(repo_id, name, revision=commit, local_dir=files_dir, endpoint=endpoint))
    return download


def _download_selection(repo_id: str, needed: NeededTensors, revision: str | None, root: Path) -> Path:
    _, commit, listing, weights = _repository(repo_id, revision)
    if not weights:
        return _download_gguf(repo_id, revision, commit, listing, root)
    download = _downloader(repo_id, commit, root)

    weight_map = None
    if SAFETENSORS_INDEX_NAME in listing:
        weight_map = json.loads(download(SAFETENSORS_INDEX_NAME).read_text())["weight_map"]
        wanted_weights = files_holding(weight_map, needed)
    else:
        wanted_weights = set(weights)
    unlisted = sorted(wanted_weights - set(weights))
    if unlisted:
        raise CheckpointError(f"model {repo_id!r}: its index names {unlisted[0]}, which the repository lacks")
    others = [name for name in listing if name not in weights and name != SAFETENSORS_INDEX_NAME
              and any(fnmatch.fnmatch(name, pattern) for pattern in NON_WEIGHT_PATTERNS)]
    fetched = {name: download(name) for name in sorted(others)}
    for name in sorted(wanted_weights):
        fetched[name] = download(name)
        expected = weights[name].lfs.sha256 if weights[name].lfs is not None else None
        if expected is not None and file_sha256(fetched[name]) != expected:
            raise CheckpointError(f"model {repo_id!r}: {name} does not match its listed SHA-256 "
                                  "(corrupted download or tampered mirror)")
    digest = digest_of_files(_listed_hashes(weights, fetched))
    folder = assemble_partial_folder(root / commit / selection_name(needed), fetched, weight_map,
                                     weights_sha256=digest, source=f"hub:{repo_id}@{commit}")
    _write_ref(root, revision, commit)
    return folder


def _write_ref(root: Path, revision: str | None, commit: str) -> None:
    ref_file = root / "refs" / (revision or DEFAULT_REVISION)
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(commit)


def _complete_gguf(commit_dir: Path) -> Path | None:
    """The GGUF downloaded and checked earlier for that commit, None when there is none."""
    folder = commit_dir / HUB_GGUF_FOLDER
    if complete_partial_folder(folder) is None:
        return None
    return next(iter(sorted(folder.glob(f"*{GGUF_SUFFIX}"))), None)


def _download_gguf(repo_id: str, revision: str | None, commit: str, listing: dict, root: Path) -> Path:
    """The repository's one GGUF file, downloaded (or resumed) whole and checked against its listed SHA-256, in a
    folder whose marker states its digest (so no host hashes it again)."""
    from huggingface_hub import hf_hub_download

    if (done := _complete_gguf(root / commit)) is not None:
        return done
    found = sorted(name for name in listing if name.lower().endswith(GGUF_SUFFIX))
    if len(found) > 1:
        raise CheckpointError(f"model {repo_id!r} holds several GGUF files ({', '.join(found)}) and no safetensors "
                              "weights: download the one to serve and pass that file as --model")
    entry, folder = listing[found[0]], root / commit / HUB_GGUF_FOLDER
    path = Path(hf_hub_download(repo_id, found[0], revision=commit, local_dir=folder,
                                endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None))
    size, digest = path.stat().st_size, file_sha256(path)
    if entry.lfs is not None and (entry.lfs.sha256, entry.lfs.size) != (digest, size):
        path.unlink()
        raise CheckpointError(f"model {repo_id!r}: {found[0]} does not match its listed SHA-256 (corrupted download "
                              "or tampered mirror)")
    marker = {"source": f"hub:{repo_id}@{commit}",
              "weights_sha256": digest_of_files([(GGUF_DIGEST_NAME, size, digest)])}
    (folder / PARTIAL_CHECKPOINT_MARKER).write_text(json.dumps(marker))
    _write_ref(root, revision, commit)
    return path


def _gguf_layout(path: Path) -> HubLayout:
    """The HubLayout of a downloaded GGUF: every tensor counts as read in the compute dtype, as the loader reads it
    (inference/memory.py)."""
    from .checksum import weights_sha256
    from .gguf_checkpoint import gguf_config_dict, layer_tensor_shapes

    tensors = [(f"layers.{layer}.{index}", "F32", list(shape))
               for layer, shapes in layer_tensor_shapes(path).items() for index, shape in enumerate(shapes)]
    return HubLayout(config=gguf_config_dict(path), tensors=tensors, weights_sha256=weights_sha256(path))


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
