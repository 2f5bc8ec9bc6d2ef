"""A GGUF split into several files (llama.cpp's gguf-split, as large models are published on the hub) is refused in
one line naming the split and how to merge it, by every path that reads a GGUF's header: a shard's load, the head's,
the header check a host plans with, publishing and a header read by HTTP ranges. Read as one file, its first part
lacked the other parts' tensors (a shard loaded the layers it held, a host planned the others as weighing nothing)
and its other parts lack the metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from hearth.inference import CheckpointError, load_head, load_layer_range
from hearth.inference.gguf_header import checked_gguf_header, parse_gguf_header
from hearth.services.weights_objects import WeightsStoreError
from hearth.services.weights_publish import check_publishable
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)


def split_into_parts(source: Path, folder: Path, tensors_per_part: int, **extra_keys) -> list[Path]:
    """`source` rewritten by the gguf package's writer as a split GGUF (the layout llama.cpp's gguf-split writes:
    every part states split.no and split.count, the first one holds the metadata), its parts in order; `extra_keys`
    (name: (value, GGUFValueType)) added to the metadata."""
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), architecture, split_max_tensors=tensors_per_part)
    for key, (value, value_type) in extra_keys.items():
        writer.add_key_value(key, value, value_type)
    for key, field in reader.fields.items():
        if key.startswith(f"{architecture}.") or key == "tokenizer.ggml.eos_token_id":
            writer.add_key_value(key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob("model-*-of-*.gguf")) or [folder / "model.gguf"]


@pytest.fixture
def parts(tiny_gguf, tmp_path):  # noqa: F811
    source = tiny_gguf("llama", GGMLQuantizationType.Q8_0)[0]
    found = split_into_parts(source, tmp_path, tensors_per_part=20)
    assert len(found) > 1
    return found


def assert_split_refusal(message: str, part: Path, parts: list[Path]) -> None:
    assert "\n" not in message, message
    assert part.name in message and f"of {len(parts)}" in message and "merge" in message, message


def test_each_part_is_refused_by_the_header_check_every_command_goes_through(parts):
    for part in parts:
        with pytest.raises(CheckpointError) as refusal:
            checked_gguf_header(part)
        assert_split_refusal(str(refusal.value), part, parts)


def test_a_shard_and_a_head_refuse_the_first_part_rather_than_load_what_it_holds(parts):
    for load in (lambda: load_layer_range(parts[0], 0, 0, **RUNNER_KV_LIMITS), lambda: load_head(parts[0])):
        with pytest.raises(CheckpointError) as refusal:
            load()
        assert_split_refusal(str(refusal.value), parts[0], parts)


def test_publishing_a_part_is_refused(parts):
    with pytest.raises(WeightsStoreError) as refusal:
        check_publishable(parts[0])
    assert_split_refusal(str(refusal.value), parts[0], parts)


def test_a_part_read_by_http_ranges_is_refused_from_its_header(parts):
    data = parts[0].read_bytes()
    with pytest.raises(CheckpointError) as refusal:
        parse_gguf_header(data, len(data), parts[0].name)
    assert_split_refusal(str(refusal.value), parts[0], parts)


def test_a_gguf_stating_a_split_of_one_file_is_whole_and_loads(tiny_gguf, tmp_path):  # noqa: F811
    source = tiny_gguf("llama", GGMLQuantizationType.Q8_0)[0]
    # As llama.cpp's gguf-split states a model it did not need to split.
    (whole,) = split_into_parts(source, tmp_path, tensors_per_part=0, **{
        "split.no": (0, GGUFValueType.UINT16), "split.count": (1, GGUFValueType.UINT16)})
    assert checked_gguf_header(whole).metadata["split.count"] == 1
    load_head(whole)


def test_a_folder_holding_the_parts_is_refused_as_a_split_gguf_not_as_a_choice_of_files(parts):
    with pytest.raises(CheckpointError) as refusal:
        load_head(parts[0].parent)
    assert_split_refusal(str(refusal.value), parts[0], parts)
