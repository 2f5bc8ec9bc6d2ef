"""What a GGUF lays out: its tensors and where each one's bytes lie (GGUFSplit), the tensor names hearth reads, and
the checks refusing a layout llama.cpp would not load (block types, data layout, a part of a split GGUF).

hearth/inference/gguf_header.py parses a header into these; hearth/inference/gguf_parts.py writes parts from them.
Which files, architectures and block types hearth serves is hearth/formats/gguf_support.py's (light, for the demo).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hearth.formats.gguf_support import unsupported_block_type

from .errors import CheckpointError

# llama.cpp's gguf-split states in every part of a GGUF split into several files its index and the parts' count.
SPLIT_COUNT_KEY = "split.count"
SPLIT_NO_KEY = "split.no"
LAYER_PREFIX = "blk"
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Phi-3's LongRoPE factors (its long and short contexts' frequency divisors).
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Tensors every decoder layer reads though none owns them (its RoPE's frequencies): a layer range's part of a GGUF
# holds them too, so a shard's config states the RoPE the whole file does (hearth/inference/gguf_config.py).
EVERY_LAYER_TENSORS = (ROPE_FREQS_TENSOR, *LONGROPE_TENSORS)


def tensor_label(name: str, index: int) -> str:
    """How a refusal names GGUF tensor info `index`: its name, or `#index (unnamed)` when the name is empty (the
    message would otherwise read "tensor  has ...")."""
    return name or f"#{index} (unnamed)"


def gguf_layer_of(tensor_name: str) -> int | None:
    """The decoder layer of a GGUF tensor name ("blk.3.attn_q.weight" -> 3), None for every other tensor."""
    parts = tensor_name.split(".")
    return int(parts[1]) if parts[0] == LAYER_PREFIX and len(parts) > 2 and parts[1].isdigit() else None


@dataclass(frozen=True)
class GGUFPartTensor:
    """One tensor of a split GGUF: where its info lies in the header and its bytes in the file."""

    name: str
    layer: int | None
    block_type: str  # the GGML type's name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # torch order
    info_start: int
    info_end: int
    data_start: int  # absolute, in the original file
    n_bytes: int


@dataclass(frozen=True)
class GGUFSplit:
    """What a GGUF is made of: its header's length (where tensor data starts), where its tensor infos start, its
    alignment and its tensors in file order."""

    header_bytes: int
    kv_end: int
    alignment: int
    tensors: tuple[GGUFPartTensor, ...]

    def groups(self) -> dict[int | None, list[GGUFPartTensor]]:
        """The tensors by decoder layer (None: the head), each group in file order."""
        grouped: dict[int | None, list[GGUFPartTensor]] = {}
        for tensor in self.tensors:
            grouped.setdefault(tensor.layer, []).append(tensor)
        return grouped


def check_block_types(tensors: Iterable[tuple[str, str]], file_name: str) -> None:
    """CheckpointError (one line) naming the first of `tensors` ((GGUF name or tensor_label, GGML type name)) stored
    in a block type hearth does not read (hearth/formats/gguf_support.py)."""
    refusal = unsupported_block_type(tensors, file_name)
    if refusal is not None:
        raise CheckpointError(refusal)


def truncated_refusal(file_name: str, what_it_needs: str, file_size: int) -> CheckpointError:
    """The one line refusing a file cut short: what it needs (its header's bytes, its tensors'), what it holds."""
    return CheckpointError(f"{file_name} is truncated: {what_it_needs}, the file holds {file_size} (re-download it)")


def check_data_layout(spans: Iterable[tuple[int, int | None, str]], data_start: int, file_size: int,
                      alignment: int, file_name: str) -> None:
    """CheckpointError (one line) when the tensors' bytes ((offset in the data section, which starts at byte
    `data_start`; bytes its block type and shape count, None when its type is unknown: it may take up to the next
    tensor; its name as a refusal says it, tensor_label)) end past the `file_size` bytes the file holds (a truncated
    file), or naming the tensor whose bytes llama.cpp would refuse: at an offset that is no multiple of `alignment`,
    overlapping the next tensor's, or followed by more bytes than it counts before the next tensor starts (a tensor
    info naming a smaller block type or shape than its bytes)."""
    # In offset order, each tensor's bytes padded to the alignment end where the next one's start, as every GGUF
    # writer (llama.cpp's, the gguf package's, Ollama's, gguf_parts') lays them and llama.cpp's loader requires: a
    # tensor info that states another size would read its neighbour's bytes, or leave some of its own unread.
    ordered = sorted(spans, key=lambda span: (span[0], span[1] or 0))
    for offset, _, name in ordered:
        if offset % alignment:
            raise CheckpointError(f"{file_name}'s header is corrupt (tensor {name}'s data offset {offset} is not a "
                                  f"multiple of the file's alignment {alignment})")
    ends = [data_start + offset + n_bytes for offset, n_bytes, _ in ordered if n_bytes is not None]
    if ends and max(ends) > file_size:
        raise truncated_refusal(file_name, f"its tensors need {max(ends)} bytes", file_size)
    for (offset, n_bytes, name), following in zip(ordered, [*ordered[1:], None]):
        if n_bytes is None:
            continue
        end = offset + n_bytes
        if following is not None and following[0] != (end + alignment - 1) // alignment * alignment:
            how = "overlap" if following[0] < end else "leave a gap before"
            raise CheckpointError(
                f"{file_name}'s header is corrupt (tensor {name}'s {n_bytes} bytes at data offset {offset}, as its "
                f"block type and shape count them, {how} tensor {following[2]}'s at {following[0]})")


class SplitGGUFError(CheckpointError):
    """A part of a GGUF split into several files (check_not_split)."""


def check_not_split(metadata: dict[str, object], file_name: str) -> None:
    """SplitGGUFError (one line) when `metadata` is that of one part of a GGUF split into several files: the first
    holds only some of the tensors (read as one file, a range would load what it holds and a host plan the rest as
    weighing nothing), the others no model metadata."""
    count = metadata.get(SPLIT_COUNT_KEY)
    if isinstance(count, int) and count > 1:
        number = metadata.get(SPLIT_NO_KEY)
        part = f"part {number + 1} of {count}" if isinstance(number, int) else f"one of {count} parts"
        raise SplitGGUFError(f"{file_name} is {part} of a split GGUF, which hearth does not read as one: merge the "
                              "parts into one file (llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf`)")
