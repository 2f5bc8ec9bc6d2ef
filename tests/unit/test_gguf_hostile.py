"""GGUF files that lie in their header (hearth/inference/gguf_checkpoint.py `checked_gguf_header`, the loader's shape
and config checks): each is refused in one line by a shard's load and by the head's, before the gguf package's
reader or transformers trust what the file declares (a metadata array of 2^62 items ran a shard out of memory)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from hearth.inference import CheckpointError, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)

DROP = object()


def rewritten(source: Path, path: Path, *, keys: dict | None = None,
              tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the llama GGUF `source` at `path`: metadata `keys` set (DROP: left out; a new key as (value,
    GGUFValueType)), `tensors` given new values."""
    keys, tensors = keys or {}, tensors or {}
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if (key.startswith("llama.") or key == "tokenizer.ggml.eos_token_id") and keys.get(key) is not DROP:
            value = keys.pop(key, field.contents())
            writer.add_key_value(key, *(value if isinstance(value, tuple) else (value, field.types[0])))
    for key, (value, value_type) in ((k, v) for k, v in keys.items() if v is not DROP):
        writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        if tensor.name in tensors:
            writer.add_tensor(tensor.name, tensors[tensor.name])
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def test_a_tensor_whose_shape_the_config_contradicts_is_refused_by_name(source, tmp_path):
    reader = gguf.GGUFReader(source)
    query = next(np.array(tensor.data) for tensor in reader.tensors if tensor.name == "blk.0.attn_q.weight")
    path = rewritten(source, tmp_path / "shape.gguf", tensors={"blk.0.attn_q.weight": query[: query.shape[0] // 2]})
    with pytest.raises(CheckpointError) as refusal:
        load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS)
    assert "\n" not in str(refusal.value) and "q_proj.weight" in str(refusal.value)


def test_a_file_cut_in_its_metadata_is_refused_by_the_head_in_one_line(source, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:200])
    refused(cut, "cut.gguf")
