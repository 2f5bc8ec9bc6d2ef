"""What a hub model id names: a repository ("owner/name"), or one GGUF file in it ("owner/name:FILE.gguf")."""

from __future__ import annotations

import re

from hearth.formats.gguf_support import GGUF_SUFFIX

# Read at each call (huggingface_hub reads it once, at import): a mirror or a test server may be named later.
HUB_ENDPOINT_ENV = "HF_ENDPOINT"

# "owner/name:FILE.gguf": a repository holding several GGUFs (Q4_K_M and Q8_0 side by side) served from one of
# them; FILE is a top-level file of the repository.
HUB_GGUF_ID_PATTERN = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}):(?P<file>[^/\\:]+)$")


def split_hub_model(model: str) -> tuple[str, str | None]:
    """(repository id, GGUF file name or None) of a hub model id: "owner/name" -> ("owner/name", None),
    "owner/name:FILE.gguf" -> ("owner/name", "FILE.gguf")."""
    found = HUB_GGUF_ID_PATTERN.match(model)
    if found is None or not found.group("file").lower().endswith(GGUF_SUFFIX):
        return model, None
    return found.group("repo"), found.group("file")


def is_hub_gguf_id(model: str) -> bool:
    """Whether `model` has the "owner/name:FILE.gguf" form."""
    return split_hub_model(model)[1] is not None
