"""The names of a safetensors checkpoint's files, what its index may name, opening one as a CheckpointError when it
does not read, the refusal of one stored quantized by another library, and the patterns of the hub files hearth
fetches."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .errors import CheckpointError, first_line

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


def check_full_precision(config: object, name: str) -> None:
    """CheckpointError (one line) when a config.json states a ``quantization_config`` (FP8, GPTQ, AWQ,
    bitsandbytes ...): its Linear weights are codes whose scales lie in tensors of their own, which transformers'
    quantizers apply and hearth's reader does not (it would serve the codes as the weights: a wrong model)."""
    stated = config.get("quantization_config") if isinstance(config, dict) else None
    if stated is not None:
        method = stated.get("quant_method") if isinstance(stated, dict) else None
        raise CheckpointError(
            f"{name} is stored quantized ({method if isinstance(method, str) else 'a quantization_config'} in its "
            "config.json), which hearth does not read: serve its full-precision checkpoint (--quantize int8 or int4 "
            "holds it quantized) or a GGUF of it")


@contextlib.contextmanager
def opened_safetensors(file: Path) -> Iterator:
    """`file` opened by safetensors (memory-mapped); a file that does not read as one, now or while its tensors are
    read (truncated by a full disk or a crash, damaged), is a CheckpointError of one line naming it."""
    try:
        with safe_open(file, framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise CheckpointError(f"{file} is no readable safetensors file ({first_line(error)}); delete it (or its "
                              "folder, for a fetched checkpoint) to fetch it again") from None
