"""Where hearth keeps what it caches on a host: the folder ($HEARTH_CACHE_DIR, default ~/.cache/hearth) and the
sub-folder of each kind of entry in it; light (no torch), so that `hearth cache` and the supervising `hearth demo`
find them without loading the model side."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

WEIGHTS_CACHE_DIR_ENV = "HEARTH_CACHE_DIR"
DEFAULT_WEIGHTS_CACHE_DIR = Path("~/.cache/hearth")
# Copies of models fetched from the community's object store, per name (hearth/services/weights_store.py).
STORE_CACHE_FOLDER = "store"
# Parts of hub models fetched by layer range, per repository (hearth/inference/hub_fetch.py).
HUB_PARTIAL_FOLDER = "hearth-partial"
# What is parsed from a GGUF's metadata, per file version (hearth/inference/gguf_cache.py).
GGUF_CACHE_DIR_NAME = "gguf"
# int4 codes a CPU host rounded a checkpoint's weights into, per checkpoint (hearth/inference/int4_code_cache.py).
INT4_CODE_CACHE_DIR_NAME = "int4-codes"
# Random checkpoints of `random:<shape>`, per shape (hearth/services/devtools/random_models.py).
RANDOM_MODELS_FOLDER = "random-models"
# In a random checkpoint's folder once it is written whole: its shape and tokenizer version.
RANDOM_MARKER_FILE = "hearth-random-shape.json"
# Held (a shared flock) by every process using a cached version of a store or hub model
# (hearth/inference/cache_versions.py).
IN_USE_LOCK = ".in-use.lock"
# A folder being removed is first renamed to .<name>.<pid><REMOVED_SUFFIX> beside it, so no process sees it half
# removed; one a process ending midway left is deleted by the next removal.
REMOVED_SUFFIX = ".removed"
# In an int4-codes or gguf entry (named by a digest): what it was made from, as {"about": text}, for `hearth cache`.
ENTRY_SOURCE_FILE = "hearth-cache-source.json"


def hearth_cache_dir() -> Path:
    """hearth's cache folder: $HEARTH_CACHE_DIR, else ~/.cache/hearth."""
    return Path(os.environ.get(WEIGHTS_CACHE_DIR_ENV) or DEFAULT_WEIGHTS_CACHE_DIR).expanduser()


def describe_entry(folder: Path, about: str) -> None:
    """Say in `folder`'s ENTRY_SOURCE_FILE what the entry was made from (nothing for an empty `about`); a folder that
    cannot be written is left as it is (the description only names the entry in `hearth cache`)."""
    if not about:
        return
    with contextlib.suppress(OSError):
        (folder / ENTRY_SOURCE_FILE).write_text(json.dumps({"about": about}))


def entry_description(folder: Path) -> str | None:
    """What describe_entry said of `folder`, None when nothing (or nothing readable) did."""
    try:
        about = json.loads((folder / ENTRY_SOURCE_FILE).read_text()).get("about")
    except (OSError, ValueError, AttributeError):
        return None
    return about if isinstance(about, str) else None
