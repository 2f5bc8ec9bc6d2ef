"""A GGUF's tensor table (each tensor's block type, where its bytes lie, its shapes) and stop tokens, taken from the
header hearth's bounded parser reads (hearth/inference/gguf_header.py) once per file version and kept in hearth's GGUF
cache (hearth/inference/gguf_cache.py). Not from the gguf package's reader: it parses every metadata array item by
item, a real vocabulary's for seconds (BENCHMARKS.md "GGUF start-up"), where the table needs none of them."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .file_version import FileVersion, file_version
from .gguf_cache import gguf_cache_entry
from .gguf_header import checked_gguf_header
from .gguf_layout import check_block_types

# GGUF metadata keys naming end-of-generation tokens besides eos (chat models end turns with them).
STOP_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                   "tokenizer.ggml.eos_token_ids")  # the last an array: Ollama's files list end-of-turn tokens there
# Parsed metadata kept per process (a shard's memory planning and loading, a head and a local model share it).
METADATA_CACHE_ENTRIES = 4
# What the table is stored as in a file's disk cache entry (hearth/inference/gguf_cache.py).
TABLE_CACHE_NAME = "table"


def gguf_package():
    """The gguf package, imported on first use: safetensors-only hosts never pay for it."""
    import gguf

    return gguf


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a GGUF file and how it is stored."""

    name: str
    block_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    stored_dtype: np.dtype  # of the array the stored bytes form (uint8 for blocks)
    stored_shape: tuple[int, ...]  # of that array
    shape: tuple[int, ...]  # of the tensor, in torch order


@dataclass(frozen=True)
class GGUFTable:
    """A GGUF's architecture, tensor table and stop tokens: everything but the tensor data."""

    architecture: str
    tensors: tuple[StoredTensor, ...]
    stop_token_ids: frozenset[int]


def gguf_table(path: Path) -> GGUFTable:
    """The GGUF's tensor table (parsed once per file version, then read from the disk cache; the reader is dropped,
    so no mapping of the file outlives the call)."""
    path = Path(path).resolve()
    return _cached_table(str(path), file_version(path.stat()))


@functools.lru_cache(maxsize=METADATA_CACHE_ENTRIES)
def _cached_table(path_text: str, version: FileVersion) -> GGUFTable:
    entry = gguf_cache_entry(path_text)
    with entry.parsing(TABLE_CACHE_NAME):
        try:
            return _table_from_json(entry.read_json(TABLE_CACHE_NAME))
        except (KeyError, TypeError, ValueError):
            pass  # none yet, or an old or damaged one
        table = _parsed_table(Path(path_text))
        entry.write_json(TABLE_CACHE_NAME, _table_to_json(table))
        return table


def _parsed_table(path: Path) -> GGUFTable:
    """The table of the text model's tensors, each stored array typed as the gguf package's reader types it (plain
    floats and integers as themselves, blocks as bytes); CheckpointError when the header is truncated or corrupt, of
    an architecture hearth does not serve, names a tensor twice or states stop tokens that are no token ids."""
    header = checked_gguf_header(path)
    gguf = gguf_package()
    tensors, names = [], set()
    for tensor in header.split.tensors:
        if tensor.name in names:
            raise CheckpointError(f"{path.name}'s header is corrupt (it names tensor {tensor.name} twice)")
        names.add(tensor.name)
        block_type = gguf.GGMLQuantizationType[tensor.block_type]
        plain = _PLAIN_ARRAY_TYPES.get(tensor.block_type)
        if plain is None and not tensor.shape:
            raise CheckpointError(f"{path.name}'s header is corrupt (tensor {tensor.name} is stored in blocks but has "
                                  "no dimensions)")
        stored_shape = tensor.shape if plain is not None else gguf.quants.quant_shape_to_byte_shape(tensor.shape,
                                                                                                 block_type)
        tensors.append(StoredTensor(tensor.name, block_type, tensor.data_start, tensor.n_bytes,
                                    np.dtype(plain or np.uint8), tuple(stored_shape), tensor.shape))
    stated = (header.metadata.get(key) for key in STOP_TOKEN_KEYS)
    try:
        stop_ids = frozenset(_token_id(token) for value in stated if value is not None
                             for token in (value if isinstance(value, list) else [value]))
    except (TypeError, ValueError):
        raise CheckpointError(f"{path.name} states stop tokens that are no token ids") from None
    return GGUFTable(header.architecture, tuple(tensors), stop_ids)


# The GGML types the gguf package's reader gives as arrays of their own values (every other as blocks of bytes).
_PLAIN_ARRAY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                      "I32": np.int32, "I64": np.int64}


def _token_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is no token id")
    return value


def _table_to_json(table: GGUFTable) -> dict:
    return {
        "architecture": table.architecture,
        "stop_token_ids": sorted(table.stop_token_ids),
        "tensors": [[t.name, t.block_type.name, t.data_offset, t.n_bytes, t.stored_dtype.str, list(t.stored_shape),
                     list(t.shape)] for t in table.tensors],
    }


def _table_from_json(stored) -> GGUFTable:
    """The table `_table_to_json` wrote; KeyError, TypeError or ValueError when `stored` is anything else."""
    block_types = gguf_package().GGMLQuantizationType
    tensors = tuple(
        StoredTensor(str(name), block_types[block_type], int(offset), int(n_bytes), np.dtype(dtype),
                     tuple(int(d) for d in stored_shape), tuple(int(d) for d in shape))
        for name, block_type, offset, n_bytes, dtype, stored_shape, shape in stored["tensors"]
    )
    return GGUFTable(str(stored["architecture"]), tensors, frozenset(int(t) for t in stored["stop_token_ids"]))


LayerBlocks = dict[int, list[tuple[tuple[int, ...], str]]]


def layer_tensor_blocks(path: Path) -> LayerBlocks:
    """(shape in torch order, GGUF block type name) of each decoder layer's tensors, from the tensor table alone."""
    return layer_blocks_of((tensor.name, tensor.shape, tensor.block_type.name) for tensor in gguf_table(path).tensors)


def layer_blocks_of(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> LayerBlocks:
    """What layer_tensor_blocks says, of tensors given as (GGUF name, shape in torch order, block type name): from a
    tensor table, or from a header read by hearth/inference/gguf_header.py (which writes no cache)."""
    blocks: LayerBlocks = {}
    for name, shape, block_type in tensors:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            blocks.setdefault(int(parts[1]), []).append((shape, block_type))
    return blocks


def check_layer_block_types(path: Path) -> None:
    """CheckpointError naming the GGUF's first decoder-layer tensor in a block type hearth does not read, from the
    tensor table alone (a command refuses it at start rather than when a layer is loaded)."""
    layer_tensors = (tensor for tensor in gguf_table(path).tensors if tensor.name.startswith("blk."))
    check_block_types(((tensor.name, tensor.block_type.name) for tensor in layer_tensors), path.name)


def gguf_layer_tensors(blocks: dict[int, list[tuple[tuple[int, ...], str]]]) -> list[tuple[str, str, list[int]]]:
    """The (name, stored type, shape) that hearth/inference/memory.py's layer_weight_bytes_of counts, of a GGUF's layer
    tensors given as {layer: [(shape, block type)]} (layer_tensor_blocks)."""
    return [(f"layers.{layer}.{index}", block_type, list(shape))
            for layer, tensors in blocks.items() for index, (shape, block_type) in enumerate(tensors)]


def header_layer_tensors(tensors: Iterable) -> list[tuple[str, str, list[int]]]:
    """gguf_layer_tensors of the tensor infos of a header read by hearth/inference/gguf_header.py (each with its
    name, shape and block type name)."""
    return gguf_layer_tensors(layer_blocks_of((tensor.name, tensor.shape, tensor.block_type) for tensor in tensors))

