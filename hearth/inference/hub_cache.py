"""What huggingface_hub's own cache already holds of a hub model, so a machine that has it serves it without any
network: a complete safetensors snapshot, or a GGUF downloaded whole (`hf download REPO FILE.gguf`, how GGUFs are
usually fetched).

The cache's snapshot folders link only files downloaded whole (huggingface_hub keeps a download in progress as an
``.incomplete`` blob until it is done), so a file linked there is complete; as for the hub cache's safetensors, its
bytes are not hashed against the listing here (its digest is then the file's own: checksum.weights_sha256).
"""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint_files import SAFETENSORS_INDEX_NAME, checked_weight_map
from .errors import CheckpointError
from hearth.formats.gguf_support import GGUF_SUFFIX
from .hub_ids import split_hub_model


def complete_hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | Path | None) -> Path | None:
    """The hub snapshot cache's folder of `repo_id` when it already holds every weight file its index names."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
        index = folder / SAFETENSORS_INDEX_NAME
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    except Exception:  # absent, or an unreadable index: not usable as it is
        return None
    names = set(checked_weight_map(weight_map, index).values())
    complete = (folder / "config.json").is_file() and all((folder / name).is_file() for name in names)
    return folder if complete and (names or any(folder.glob("*.safetensors"))) else None


def hub_cache_gguf(model: str, revision: str | None, cache_dir: str | Path | None) -> Path | None:
    """The GGUF hub id `model` names ("owner/name:FILE.gguf", or a plain id whose snapshot holds one GGUF and no
    config.json) when the hub snapshot cache holds it, else None; CheckpointError (one line) for a plain id whose
    snapshot holds several (which one to serve would be a guess)."""
    from huggingface_hub import snapshot_download

    repo_id, file = split_hub_model(model)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                        allow_patterns=[file or f"*{GGUF_SUFFIX}"]))
    except Exception:  # not in the cache, or no hub id
        return None
    if file is not None:
        return folder / file if (folder / file).is_file() else None
    if (folder / "config.json").is_file():
        return None
    found = sorted(entry.name for entry in folder.iterdir()
                   if entry.is_file() and entry.name.lower().endswith(GGUF_SUFFIX))
    if len(found) > 1:
        raise CheckpointError(f"model {repo_id!r} holds several GGUF files in the hub cache ({', '.join(found)}): "
                              f"name the one to serve, as {repo_id}:{found[0]}")
    return folder / found[0] if found else None
