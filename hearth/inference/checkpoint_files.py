"""The names of a safetensors checkpoint's files, what its index may name, and the patterns of the hub files hearth
fetches."""

from pathlib import Path

from .errors import CheckpointError

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SINGLE_NAME = "model.safetensors"
# What a snapshot needs for hearth: config, weights, tokenizer and chat template files; never *.bin/*.pt.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def checked_weight_map(weight_map: object, index: Path) -> dict[str, str]:
    """`weight_map` (tensor -> file) of the safetensors index `index` when each file is a plain name of a file in the
    index's folder; CheckpointError (one line) otherwise: a path out of it would load bytes the checkpoint's digest
    does not cover."""
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map of tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file:
            raise CheckpointError(f"{index} maps {str(name)[:80]!r} to {str(file)[:120]!r}, not a file of its folder")
    return weight_map
