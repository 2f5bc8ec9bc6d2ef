"""A GGUF file split into the parts a shard host or an orchestrator needs, and such parts written back as a GGUF.

Every byte stays as the GGUF holds it. The header is the file's bytes before its tensor data (magic, version,
counts, metadata key/values, tensor infos); a decoder layer's data is its tensors' (``blk.N.*``) bytes in the file's
order, concatenated; the head's is every other tensor's (embedding, final norm, output), except a vision or audio
encoder's that Ollama bundles (gguf_support.is_text_model_tensor), which no part holds. A part written back is a
GGUF holding the original's metadata and only the chosen tensors, each tensor info copied with only its data offset
changed and the tensors in their block types (Q4_1 stays Q4_1), so the loader reads it as it reads the original
(hearth/inference/gguf_checkpoint.py). Written whole, in the original's order, a GGUF laid out as llama.cpp and the gguf
package write them comes back byte for byte. A layer range's GGUF lists no `output.weight`, so transformers reads
its config as having tied embeddings; a range holds no head, so nothing it loads depends on that.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .gguf_header import read_gguf_header
from hearth.formats.gguf_support import is_gguf_file
from .gguf_layout import EVERY_LAYER_TENSORS, GGUFPartTensor, GGUFSplit
from .partial_checkpoint import complete_partial_folder, staged_partial_folder

# After the magic and the version: the tensor count, a little-endian u64 (GGUF versions 2 and 3).
TENSOR_COUNT_OFFSET = 8
TENSOR_COUNT_FORMAT = "<Q"
# A tensor info ends with its data offset (u64), relative to the start of the data section.
INFO_OFFSET_BYTES = 8
COPY_CHUNK_BYTES = 8 << 20


def split_gguf(path: Path) -> GGUFSplit:
    """The GGUFSplit of the GGUF at `path`, refused (CheckpointError, one line) when the loader would refuse it:
    truncated, of an architecture or a block type hearth does not read, big-endian. Read by hearth's own header
    parser, which steps over the vocabulary where the gguf package's reader decodes every token of it."""
    from .gguf_checkpoint import gguf_config_dict

    split = read_gguf_header(path, check_tensors=True).split  # truncation, block types, byte order
    gguf_config_dict(path)  # the model type, as the loader checks it
    return split


def read_header(path: Path, split: GGUFSplit) -> bytes:
    """The GGUF's bytes before its tensor data."""
    with path.open("rb") as handle:
        return handle.read(split.header_bytes)


def read_tensor_data(path: Path, tensors: Iterable[GGUFPartTensor]) -> bytes:
    """The stored bytes of `tensors`, concatenated in the order given."""
    chunks = []
    with path.open("rb") as handle:
        for tensor in tensors:
            handle.seek(tensor.data_start)
            chunks.append(handle.read(tensor.n_bytes))
    return b"".join(chunks)


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor of a part to write comes from: its info's span in the header, its bytes in a file."""

    info_start: int
    info_end: int
    file: Path
    offset: int
    n_bytes: int


def write_gguf_part(target: Path, header: bytes, kv_end: int, alignment: int, tensors: list[TensorSource]) -> Path:
    """Write at `target` a GGUF with `header`'s metadata (its bytes up to `kv_end`) and `tensors`, in that order;
    written beside it and renamed into place, so a reader never sees a torn file. CheckpointError when a span lies
    outside the header or a source file is too short."""
    if not (TENSOR_COUNT_OFFSET + 16 <= kv_end <= len(header)) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{target.name}: the GGUF header's layout does not fit its {len(header)} bytes")
    for source in tensors:
        if not (kv_end <= source.info_start and source.info_start + INFO_OFFSET_BYTES <= source.info_end
                <= len(header)) or source.offset < 0 or source.n_bytes < 0:
            raise CheckpointError(f"{target.name}: a tensor's info or bytes lie outside its parts")
    from . import checksum
    from .hub_download import byte_progress

    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    total = sum(source.n_bytes for source in tensors)
    try:  # a bar from a weight file's size on: a large model's range takes minutes to copy
        with os.fdopen(descriptor, "wb") as out, byte_progress(
                total, f"writing {target.name}", shown=total >= checksum.HASH_PROGRESS_MIN_BYTES) as bar:
            out.write(header[:TENSOR_COUNT_OFFSET])
            out.write(struct.pack(TENSOR_COUNT_FORMAT, len(tensors)))
            out.write(header[TENSOR_COUNT_OFFSET + 8:kv_end])
            offset = 0
            for source in tensors:
                out.write(header[source.info_start:source.info_end - INFO_OFFSET_BYTES])
                out.write(struct.pack("<Q", offset))
                offset += _aligned(source.n_bytes, alignment)
            out.write(bytes(_aligned(out.tell(), alignment) - out.tell()))
            for source in tensors:
                _copy(source, out, target.name, bar)
                out.write(bytes(_aligned(source.n_bytes, alignment) - source.n_bytes))
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _aligned(position: int, alignment: int) -> int:
    return (position + alignment - 1) // alignment * alignment


def _copy(source: TensorSource, out, target_name: str, bar) -> None:
    with source.file.open("rb") as handle:
        handle.seek(source.offset)
        left = source.n_bytes
        while left:
            chunk = handle.read(min(left, COPY_CHUNK_BYTES))
            if not chunk:
                raise CheckpointError(f"{target_name}: {source.file.name} ends before a tensor's bytes do")
            out.write(chunk)
            bar.update(len(chunk))
            left -= len(chunk)



@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor of a GGUF stored in parts lies: its info's span in the header part, its bytes' span in the
    part `file`."""

    name: str
    file: str
    offset: int
    n_bytes: int
    info_start: int
    info_end: int


def publishable_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names (itself, an Ollama model's blob for `ollama:NAME[:TAG]`, or the one GGUF of a
    folder without config.json), checked as the loader checks it (split_gguf), None when it names none;
    CheckpointError (one line) for a GGUF the loader would refuse or a folder holding several."""
    from .gguf_checkpoint import single_gguf_in
    from .ollama_models import is_ollama_model, resolve_ollama_model

    if is_ollama_model(str(path)):
        path = resolve_ollama_model(str(path))
    if not is_gguf_file(path):
        if not path.is_dir():
            return None
        try:
            path = single_gguf_in(path)
        except CheckpointError:
            raise CheckpointError(f"{path} holds several GGUF files: publish one of them") from None
    if path is not None:
        split_gguf(path)
    return path


@dataclass(frozen=True)
class StoredLayout:
    """What the parts of a GGUF need besides their bytes to form it again: where its tensor infos start in the
    header part, its alignment, and each tensor's TensorPlacement in the original file's order."""

    kv_end: int
    alignment: int
    placements: list[TensorPlacement]


def stored_parts(path: Path, header_file: str, file_of: Callable[[int | None], str], every_layer_file: str):
    """(the GGUF's StoredLayout, its number of decoder layers, and each part read one at a time: (file, kind,
    layer, bytes, {tensor name: (GGML type name, shape)})): the header part `header_file` (kind "gguf_header")
    first, then, when the GGUF has any, the tensors every layer reads (kind "every_layer", `every_layer_file`), the
    head's (kind "head", named `file_of(None)`) and each layer's (kind "layer", `file_of(layer)`). CheckpointError
    (one line) for a GGUF the loader would refuse."""
    from .gguf_checkpoint import gguf_config_dict

    split = split_gguf(path)
    num_layers = int(gguf_config_dict(path)["num_hidden_layers"])
    groups = split.groups()
    every_layer = [tensor for tensor in groups.get(None, []) if tensor.name in EVERY_LAYER_TENSORS]
    if every_layer:
        groups[None] = [tensor for tensor in groups[None] if tensor.name not in EVERY_LAYER_TENSORS]
    parts_in_order = [(every_layer_file, "every_layer", None, every_layer)] if every_layer else []
    parts_in_order += [(file_of(layer), "head" if layer is None else "layer", layer, groups[layer])
                       for layer in sorted(groups, key=lambda layer: -1 if layer is None else layer) if groups[layer]]
    placements = []
    for file, _, _, tensors in parts_in_order:
        offset = 0
        for tensor in tensors:
            placements.append(TensorPlacement(tensor.name, file, offset, tensor.n_bytes, tensor.info_start,
                                              tensor.info_end))
            offset += tensor.n_bytes
    placements.sort(key=lambda placement: placement.info_start)

    def parts():
        yield header_file, "gguf_header", None, read_header(path, split), {}
        for file, kind, layer, tensors in parts_in_order:
            specs = {tensor.name: (tensor.block_type, list(tensor.shape)) for tensor in tensors}
            yield file, kind, layer, read_tensor_data(path, tensors), specs
    return StoredLayout(split.kv_end, split.alignment, placements), num_layers, parts()


def write_gguf_folder(target: Path, gguf_name: str, header_file: str, layout: StoredLayout,
                      files: Mapping[str, Path], *, weights_sha256: str, source: str) -> Path:
    """The GGUF `gguf_name` in folder `target`, holding the metadata of the header part `header_file` and the
    tensors whose parts are in `files` (part file -> local file), beside the PARTIAL_CHECKPOINT_MARKER stating the
    whole GGUF's digest (the one weights_sha256 then reports for it). Built beside `target` and renamed into place,
    so two hosts writing the same part at once both end up with a complete folder. CheckpointError when the parts
    do not form a readable GGUF."""
    if (done := complete_partial_folder(target)) is not None:
        return done / gguf_name
    if header_file not in files:
        raise CheckpointError(f"the parts of {gguf_name} lack its header {header_file}")
    placements = layout.placements
    wanted = [placement for placement in placements if placement.file in files]
    _check_placements(gguf_name, placements, wanted, files)
    with staged_partial_folder(target, weights_sha256=weights_sha256, source=source) as staging:
        written = write_gguf_part(
            staging / gguf_name, files[header_file].read_bytes(), layout.kv_end, layout.alignment,
            [TensorSource(p.info_start, p.info_end, files[p.file], p.offset, p.n_bytes) for p in wanted])
        # Each tensor's bytes as its info's shape and block type count them: a layout stating other sizes would
        # leave a tensor reading its neighbour's bytes, or the last one past the end.
        try:
            written_tensors = read_gguf_header(written, check_tensors=bool(wanted)).split.tensors
        except CheckpointError as error:
            raise CheckpointError(f"the parts of {gguf_name} do not form a GGUF: {error}") from None
        if [(tensor.name, tensor.n_bytes) for tensor in written_tensors] != [(p.name, p.n_bytes) for p in wanted]:
            raise CheckpointError(f"the parts of {gguf_name} do not form a GGUF: the tensor table does not match "
                                  "its header")
    return target / gguf_name


def _check_placements(gguf_name: str, placements: list[TensorPlacement], wanted: list[TensorPlacement],
                      files: Mapping[str, Path]) -> None:
    """CheckpointError unless each tensor is placed once, no two tensor infos or byte spans in one part overlap, and
    the spans written lie within their fetched parts: a layout repeating a placement would have one part's bytes
    written many times over, and the written header's check compares tables holding the same repeats."""
    def refused(why: str) -> CheckpointError:
        return CheckpointError(f"the parts of {gguf_name} do not form a GGUF: its layout {why}")

    if len({placement.name for placement in placements}) != len(placements):
        raise refused("places a tensor twice")
    if any(min(p.offset, p.n_bytes, p.info_start, p.info_end - p.info_start) < 0 for p in placements):
        raise refused("states a negative offset or size")
    infos = sorted((p.info_start, p.info_end) for p in placements)
    spans = sorted((p.file, p.offset, p.offset + p.n_bytes) for p in placements)
    if any(start < end for (_, end), (start, _) in zip(infos, infos[1:])) or any(
            file == next_file and start < end for (file, _, end), (next_file, start, _) in zip(spans, spans[1:])):
        raise refused("overlaps two tensors")
    # Spans apart and within their parts: the bytes written are at most the fetched parts' sizes together.
    sizes = {file: files[file].stat().st_size for file in {placement.file for placement in wanted}}
    if past := next((p for p in wanted if p.offset + p.n_bytes > sizes[p.file]), None):
        raise CheckpointError(f"the parts of {gguf_name} do not form a GGUF: {past.file} ends before a tensor's bytes "
                              "do")
