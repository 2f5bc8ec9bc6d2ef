"""A GGUF's header parsed from the file's first bytes alone, without the tensor data, into what it lays out
(hearth/inference/gguf_layout.py's GGUFSplit: its tensors and where each one's bytes lie).

A GGUF read over HTTP ranges (hearth/inference/hub_gguf.py) has only its leading bytes here: the gguf package's reader
maps a whole file, so this walks the header itself (magic, version, counts, key/values, tensor infos, as the GGUF
specification lays them out, little-endian versions 2 and 3) and says how many more bytes it needs when the
buffer ends first. The result is the same GGUFSplit that hearth/inference/gguf_parts.py makes from a whole file, so a
part is written from ranged bytes exactly as from the file. A local file's header is read here too before anything
that trusts what it declares (`checked_gguf_header`).
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hearth.formats.gguf_support import GGUF_MAGIC, is_text_model_tensor, unsupported_architecture

from .errors import CheckpointError
from .file_version import FileVersion, file_version
from .gguf_layout import (
    GGUFPartTensor,
    GGUFSplit,
    check_block_types,
    check_data_layout,
    check_not_split,
    gguf_layer_of,
    tensor_label,
    truncated_refusal,
)

SUPPORTED_GGUF_VERSIONS = (2, 3)
ALIGNMENT_KEY = "general.alignment"
ARCHITECTURE_KEY = "general.architecture"
# Counts past these are no model hearth could serve; a header claiming them is corrupt (or not little-endian).
MAX_TENSOR_COUNT = 1 << 20
MAX_KV_COUNT = 1 << 20
MAX_TENSOR_DIMS = 8
# llama.cpp refuses a tensor name of GGML_MAX_NAME (64) bytes or more.
MAX_TENSOR_NAME_BYTES = 64
# What read_gguf_header reads first; a header with a large vocabulary takes more, read as it asks.
FIRST_HEADER_READ_BYTES = 1 << 20
# A header beyond this is refused: no tokenizer needs it, and a bogus file must not make a host read without end.
MAX_GGUF_HEADER_BYTES = 64 << 20
# Arrays of arrays nested deeper than this are refused: no model's metadata nests them, and the parser recurses.
MAX_ARRAY_NESTING = 8
# The most layers a GGUF may declare: a skeleton is built for every one it declares (and the mesh's adverts allow
# no more).
MAX_GGUF_BLOCK_COUNT = 4096
# Files whose checked header a process keeps (a shard's planning and loading, a head and a local model share them).
CHECKED_HEADERS_KEPT = 4
# GGUF value type ids (the specification's gguf_type) and the bytes of each fixed-size one.
STRING_TYPE = 8
# A string's length, before its bytes.
STRING_LENGTH = struct.Struct("<Q")
ARRAY_TYPE = 9
FIXED_TYPE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                      12: "<d"}
# Fixed-size arrays in the metadata up to this many items are read (Gemma 3's per-layer pattern); longer ones (a
# vocabulary's scores and types) are skipped.
MAX_READ_ARRAY_ITEMS = 1024


class HeaderIncomplete(Exception):
    """The buffer ends inside the header: at least `needed` bytes of the file are required."""

    def __init__(self, needed: int):
        super().__init__(f"the GGUF header needs at least {needed} bytes")
        self.needed = needed


@dataclass(frozen=True)
class MetadataEntry:
    """Where one key/value of the header lies (from its key's length to its value's end), and its array's item
    count when the value is an array."""

    key: str
    start: int
    end: int
    array_items: int | None


@dataclass(frozen=True)
class ParsedGGUFHeader:
    """A GGUF header parsed from leading bytes: its split (tensor infos and where each tensor's bytes lie), and the
    architecture it names."""

    split: GGUFSplit
    architecture: str | None
    # Scalar and string values by key, short arrays of scalars as lists; longer arrays (the vocabulary and the like)
    # are skipped and read as None.
    metadata: dict[str, object] = field(default_factory=dict)
    # Every key/value as laid out, in file order (the byte spans lie within split.kv_end).
    metadata_entries: tuple[MetadataEntry, ...] = ()


class _Cursor:
    def __init__(self, buffer: bytes, file_name: str):
        self.buffer = buffer
        self.file_name = file_name
        self.position = 0
        self.array_items: int | None = None  # of the last array value read at the top level

    def take(self, count: int) -> bytes:
        start = self.position
        self.skip(count)
        return self.buffer[start:self.position]

    def skip(self, count: int) -> None:
        end = self.position + count
        if end > len(self.buffer):
            raise HeaderIncomplete(end)
        self.position = end

    def skip_strings(self, count: int) -> None:
        """Past `count` strings (a vocabulary's tokens or merges), none decoded nor copied: a real vocabulary holds
        hundreds of thousands."""
        buffer, position, size = self.buffer, self.position, len(self.buffer)
        for _ in range(count):
            if position + STRING_LENGTH.size > size:
                raise HeaderIncomplete(position + STRING_LENGTH.size)
            position += STRING_LENGTH.size + STRING_LENGTH.unpack_from(buffer, position)[0]
        if position > size:
            raise HeaderIncomplete(position)
        self.position = position

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.unpack("<Q"))

    def value(self, value_type: int, nesting: int = 0):
        """The value of `value_type` here: scalars and strings decoded, short arrays of scalars as lists, other
        arrays skipped (None); `nesting`: how many arrays hold it."""
        if value_type in FIXED_TYPE_FORMATS:
            return self.unpack(FIXED_TYPE_FORMATS[value_type])
        if value_type == STRING_TYPE:
            return self.string().decode("utf-8", errors="replace")
        if value_type != ARRAY_TYPE:
            raise CheckpointError(f"{self.file_name}'s header is corrupt (a metadata value of the unknown type "
                                  f"{value_type})")
        if nesting >= MAX_ARRAY_NESTING:
            raise CheckpointError(f"{self.file_name}'s header is corrupt (metadata arrays nested deeper than "
                                  f"{MAX_ARRAY_NESTING})")
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if not nesting:
            self.array_items = count
        if item_type in FIXED_TYPE_FORMATS and count <= MAX_READ_ARRAY_ITEMS:
            return list(struct.unpack(f"<{count}{FIXED_TYPE_FORMATS[item_type].lstrip('<')}",
                                      self.take(count * struct.calcsize(FIXED_TYPE_FORMATS[item_type]))))
        if item_type in FIXED_TYPE_FORMATS:
            self.skip(count * struct.calcsize(FIXED_TYPE_FORMATS[item_type]))
        elif item_type == STRING_TYPE:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item_type, nesting + 1)
        return None


def parse_gguf_header(buffer: bytes, file_size: int, file_name: str, *, check_tensors: bool = True
                      ) -> ParsedGGUFHeader:
    """The header of the GGUF of `file_size` bytes whose first bytes are `buffer`. HeaderIncomplete when `buffer`
    ends inside it; CheckpointError (one line) when it is no GGUF hearth reads, its tensors' bytes end past
    `file_size` or are not laid out as llama.cpp lays them (check_data_layout), or (`check_tensors`) it holds no
    tensor or one in a block type hearth does not read (unchecked, a tensor of a type the gguf package does not know
    counts no bytes)."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    cursor = _Cursor(buffer, file_name)
    if cursor.take(4) != GGUF_MAGIC:
        raise CheckpointError(f"{file_name} is not a GGUF file (no GGUF magic)")
    version = cursor.unpack("<I")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise CheckpointError(f"{file_name} is a GGUF of version {version} (or the other byte order): hearth reads "
                              "little-endian GGUF versions 2 and 3")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    if tensor_count > MAX_TENSOR_COUNT or kv_count > MAX_KV_COUNT:
        raise CheckpointError(f"{file_name}'s header is corrupt ({tensor_count} tensors, {kv_count} keys)")
    metadata, entries = {}, []
    for _ in range(kv_count):
        start, cursor.array_items = cursor.position, None
        key = cursor.string().decode("utf-8", errors="replace")
        metadata[key] = cursor.value(cursor.unpack("<I"))
        entries.append(MetadataEntry(key, start, cursor.position, cursor.array_items))
    check_not_split(metadata, file_name)
    kv_end = cursor.position
    infos = []
    for index in range(tensor_count):
        info_start = cursor.position
        name = _tensor_name(cursor, index, file_name)
        label = tensor_label(name, index)
        n_dims = cursor.unpack("<I")
        if n_dims > MAX_TENSOR_DIMS:
            raise CheckpointError(f"{file_name}'s header is corrupt (tensor {label} has {n_dims} dimensions)")
        dims = [cursor.unpack("<Q") for _ in range(n_dims)]
        type_id, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        infos.append((name, dims, type_id, offset, info_start, cursor.position, label))
    alignment = metadata.get(ALIGNMENT_KEY) or GGUF_DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{file_name}'s header states an invalid alignment {alignment!r}")
    data_start = (cursor.position + alignment - 1) // alignment * alignment
    known = {int(member): member for member in GGMLQuantizationType}
    spans = []  # (offset, bytes or None when the block type is unknown, label) of every tensor, other modalities' too
    for _, dims, type_id, offset, *_, label in infos:
        block_size, type_size = GGML_QUANT_SIZES.get(known.get(type_id), (None, None))
        if block_size is not None and dims and dims[0] % block_size:
            raise CheckpointError(f"{file_name}'s header is corrupt (tensor {label}'s rows of {dims[0]} values are "
                                  f"no whole number of {known[type_id].name} blocks of {block_size})")
        spans.append((offset, None if block_size is None else math.prod(dims) // block_size * type_size, label))
    check_data_layout(spans, data_start, file_size, alignment, file_name)
    text = [(info, span[1]) for info, span in zip(infos, spans) if is_text_model_tensor(info[0])]
    type_names = [known[info[2]].name if info[2] in known else f"type {info[2]}" for info, _ in text]
    if check_tensors:
        if not text:
            raise CheckpointError(f"{file_name} holds no tensors of a text model")
        check_block_types(((info[6], type_name) for (info, _), type_name in zip(text, type_names)), file_name)
    tensors = []
    for ((name, dims, _, offset, info_start, info_end, _), n_bytes), type_name in zip(text, type_names):
        tensors.append(GGUFPartTensor(
            name=name, layer=gguf_layer_of(name), block_type=type_name, shape=tuple(reversed(dims)),
            info_start=info_start, info_end=info_end, data_start=data_start + offset, n_bytes=n_bytes or 0))
    split = GGUFSplit(header_bytes=data_start, kv_end=kv_end, alignment=alignment, tensors=tuple(tensors))
    architecture = metadata.get(ARCHITECTURE_KEY)
    return ParsedGGUFHeader(split=split, architecture=architecture if isinstance(architecture, str) else None,
                            metadata=metadata, metadata_entries=tuple(entries))


def _tensor_name(cursor: _Cursor, index: int, file_name: str) -> str:
    """The name of tensor info `index` at the cursor; CheckpointError when it is as long as llama.cpp refuses, or no
    printable UTF-8 (a corrupt length swallows the next infos' bytes: every refusal naming the tensor would then
    print them, control bytes included)."""
    length = cursor.unpack("<Q")
    if length >= MAX_TENSOR_NAME_BYTES:
        raise CheckpointError(f"{file_name}'s header is corrupt (tensor #{index}'s name is {length} bytes long; "
                              f"GGUF names are shorter than {MAX_TENSOR_NAME_BYTES})")
    name = cursor.take(length).decode("utf-8", errors="replace")
    if not name.isprintable() or "\ufffd" in name:
        raise CheckpointError(f"{file_name}'s header is corrupt (tensor #{index}'s name {ascii(name)} is no printable "
                              "UTF-8)")
    return name


def read_gguf_header(path: Path, *, check_tensors: bool = False) -> ParsedGGUFHeader:
    """The header of the local GGUF at `path` (its tensors checked only with `check_tensors`, parse_gguf_header: a
    part of a GGUF may hold none), reading only as many of its leading bytes as the header takes (at most
    MAX_GGUF_HEADER_BYTES); CheckpointError (one line) when the file is empty, its header states more bytes than that
    bound, it is truncated (cut inside its header, or shorter than its tensor infos say its tensors need), or a text
    tensor's block type id is one GGML does not define."""
    file_size = path.stat().st_size
    if not file_size:
        raise CheckpointError(f"{path.name} is empty (0 bytes): not a GGUF file")
    wanted = min(file_size, FIRST_HEADER_READ_BYTES)
    while True:
        with path.open("rb") as handle:
            buffer = handle.read(wanted)
        try:
            header = parse_gguf_header(buffer, file_size, path.name, check_tensors=check_tensors)
        except HeaderIncomplete as incomplete:
            # Past the bound first: a length no header has (2^62) is corruption, which re-downloading will not mend.
            if incomplete.needed > MAX_GGUF_HEADER_BYTES:
                raise CheckpointError(f"{path.name}'s header is longer than {MAX_GGUF_HEADER_BYTES} bytes (it states "
                                      f"at least {incomplete.needed}), hearth's bound on a GGUF header: corrupt, or "
                                      "not a GGUF hearth reads") from None
            if incomplete.needed > file_size:
                raise truncated_refusal(path.name, f"its header needs at least {incomplete.needed} bytes",
                                        file_size) from None
            wanted = min(file_size, MAX_GGUF_HEADER_BYTES, max(incomplete.needed, 2 * wanted))
            continue
        # A text tensor of a type id no GGML version defines, refused by its name: the gguf package's reader and
        # transformers', which every local file meets next, fail on it in words that name neither.
        from gguf import GGMLQuantizationType

        check_block_types(((tensor.name, tensor.block_type) for tensor in header.split.tensors
                           if tensor.block_type not in GGMLQuantizationType.__members__), path.name)
        return header


def checked_gguf_header(path: Path) -> ParsedGGUFHeader:
    """`path`'s header read by hearth's bounded parser, before the gguf package's reader or transformers' see the
    file (they trust what it declares: a metadata array of 2^62 items, or nested thousands deep, runs them out of
    memory or stack); CheckpointError (one line) when it is truncated, corrupt (tensor bytes overlapping, misaligned
    or not filling what their infos state: check_data_layout; a block type id GGML does not define), of an
    architecture hearth does not serve, or declares a layer count no model has, or one its tensors contradict. Parsed
    once per file version."""
    return _checked_header(str(path.resolve()), file_version(path.stat()))


@functools.lru_cache(maxsize=CHECKED_HEADERS_KEPT)
def _checked_header(path_text: str, version: FileVersion) -> ParsedGGUFHeader:
    path = Path(path_text)
    # Tensors' block types are checked where a range is read: a file may hold only metadata (a hub download's, sized
    # from it), or a block type hearth does not read in layers it is not asked for. Their bytes' layout is checked
    # by the parser, for every tensor, and a type id no GGML version defines by read_gguf_header.
    header = read_gguf_header(path, check_tensors=False)
    architecture = header.architecture
    refusal = unsupported_architecture(architecture, path.name)
    if refusal is not None:
        raise CheckpointError(refusal)
    block_count = header.metadata.get(f"{architecture}.block_count")
    if type(block_count) is not int or not 1 <= block_count <= MAX_GGUF_BLOCK_COUNT:
        raise CheckpointError(f"GGUF {path.name} states {architecture}.block_count {block_count!r}: a model's layer "
                              f"count is a whole number from 1 to {MAX_GGUF_BLOCK_COUNT}")
    beyond = [tensor.name for tensor in header.split.tensors if (tensor.layer or 0) >= block_count]
    if beyond:
        raise CheckpointError(f"GGUF {path.name} holds {beyond[0]}, a layer past its {block_count} layers "
                              f"({architecture}.block_count)")
    return header
