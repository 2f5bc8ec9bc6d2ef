"""A GGUF's metadata without its tokenizer's long arrays, written as a small stand-in file for transformers' config
reader: what that reader takes from a GGUF for a config is the metadata's scalars and short arrays, the vocabulary's
length and whether an `output.weight` tensor exists, while reading the vocabulary, its scores, types and merges (item
by item, through the gguf package's reader) took it seconds on a real model's (BENCHMARKS.md "GGUF start-up").

The stand-in holds the file's other key/values byte for byte (as its header lays them out,
hearth/inference/gguf_header.py), `<architecture>.vocab_size` where the file states none (the vocabulary's length,
which transformers would have counted), and no tensors: transformers then takes the head for tied to the
embedding, so `tie_word_embeddings` is set from the file's own tensors (`transformers_gguf_config`).
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

from hearth.formats.gguf_support import GGUF_MAGIC

from .gguf_header import MAX_READ_ARRAY_ITEMS, ParsedGGUFHeader

VOCABULARY_KEY = "tokenizer.ggml.tokens"
# The prefix of the keys whose long arrays the stand-in leaves out (the vocabulary and its scores, types and merges).
TOKENIZER_PREFIX = "tokenizer."
# llama.cpp's converter writes no output tensor when the head is tied to the embedding.
OUTPUT_TENSOR = "output.weight"
_UINT32_TYPE = 4  # the GGUF value type id of a uint32


def transformers_gguf_config(path: Path, header: ParsedGGUFHeader):
    """The config transformers' GGUF reader makes of the GGUF at `path` (whose header is `header`), read from a
    stand-in of its metadata; what that reader raises, it raises."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="hearth-gguf-config-") as folder:
        stand_in = Path(folder) / path.name
        stand_in.write_bytes(stand_in_bytes(path, header))
        config = AutoConfig.from_pretrained(folder, gguf_file=stand_in.name)
    config.tie_word_embeddings = all(tensor.name != OUTPUT_TENSOR for tensor in header.split.tensors)
    config.name_or_path = str(path.parent)  # where transformers would have read it, not the stand-in's folder
    return config


def stand_in_bytes(path: Path, header: ParsedGGUFHeader) -> bytes:
    """A GGUF of `path`'s version holding its metadata but the tokenizer's arrays of more than MAX_READ_ARRAY_ITEMS
    items, the vocabulary's length as `<architecture>.vocab_size` where none is stated, and no tensors."""
    with path.open("rb") as handle:
        head = handle.read(header.split.kv_end)
    kept = [entry for entry in header.metadata_entries
            if not (entry.key.startswith(TOKENIZER_PREFIX) and (entry.array_items or 0) > MAX_READ_ARRAY_ITEMS)]
    values = [head[entry.start:entry.end] for entry in kept]
    vocab_size_key = f"{header.architecture}.vocab_size"
    vocabulary = next((entry for entry in header.metadata_entries if entry.key == VOCABULARY_KEY), None)
    if vocab_size_key not in header.metadata and vocabulary is not None and vocabulary.array_items is not None:
        key = vocab_size_key.encode()
        values.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", _UINT32_TYPE, vocabulary.array_items))
    version = struct.unpack_from("<I", head, len(GGUF_MAGIC))[0]
    return GGUF_MAGIC + struct.pack("<IQQ", version, 0, len(values)) + b"".join(values)
