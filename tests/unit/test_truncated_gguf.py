"""A GGUF cut short (in its metadata, in its tensor infos, in its tensor data, at its data offset, or empty) is
refused in one line saying how many bytes it needs and how many it holds, by every entry a command takes a GGUF
through: the header check (shards, hosts, orchestrators), publishing, the loaders, and the demo's description (demo,
bench, eval), before any tensor is read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError, load_head, load_layer_range
from hearth.inference.gguf_header import checked_gguf_header, read_gguf_header
from hearth.inference.loading import check_checkpoint
from hearth.services.devtools.demo_model import DemoError, resolve_demo_model
from hearth.services.weights_objects import WeightsStoreError
from hearth.services.weights_publish import check_publishable
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import TINY_NUM_LAYERS

CUTS = ("in-its-metadata", "in-its-tensor-infos", "in-its-tensor-data", "at-its-data-offset", "empty")
# Cuts that leave the whole header: the file is refused for what its tensors need.
HEADER_WHOLE_CUTS = ("in-its-tensor-data", "at-its-data-offset")


def cut_length(source: Path, cut: str) -> int:
    """Where `cut` leaves `source`: how many of its leading bytes remain."""
    data = source.read_bytes()
    reader = gguf.GGUFReader(source)
    first_name = reader.tensors[0].name.encode()
    infos_start = data.index(struct.pack("<Q", len(first_name)) + first_name)
    return {"in-its-metadata": 200, "in-its-tensor-infos": infos_start + 40,
            "in-its-tensor-data": (reader.data_offset + len(data)) // 2, "at-its-data-offset": reader.data_offset,
            "empty": 0}[cut]


def expected_refusal(source: Path, cut: str, length: int) -> str:
    """The one line that names what is wrong with `source` cut to `length` bytes."""
    if cut == "empty":
        return r"^cut\.gguf is empty \(0 bytes\): not a GGUF file$"
    if cut in HEADER_WHOLE_CUTS:
        return (rf"^cut\.gguf is truncated: its tensors need {source.stat().st_size} bytes, the file holds {length} "
                r"\(re-download it\)$")
    return rf"^cut\.gguf is truncated: its header needs at least \d+ bytes, the file holds {length} \(re-download it\)$"


@pytest.fixture
def source(tiny_gguf):  # noqa: F811
    return tiny_gguf("llama", GGMLQuantizationType.Q8_0)[0]


@pytest.fixture(params=CUTS)
def cut_file(request, source, tmp_path) -> tuple[Path, str]:
    length = cut_length(source, request.param)
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "cut.gguf"
    path.write_bytes(source.read_bytes()[:length])
    return path, expected_refusal(source, request.param, length)


def test_the_header_check_every_model_command_goes_through_says_how_short_the_file_is(cut_file):
    path, refusal = cut_file
    for check in (checked_gguf_header, read_gguf_header, check_checkpoint):
        with pytest.raises(CheckpointError, match=refusal):
            check(path)


def test_the_loaders_refuse_a_cut_gguf_in_the_same_line(cut_file):
    path, refusal = cut_file
    for load in (lambda: load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS), lambda: load_head(path)):
        with pytest.raises(CheckpointError, match=refusal):
            load()


def test_publishing_refuses_a_cut_gguf_in_the_same_line(cut_file):
    path, refusal = cut_file
    for named in (path, path.parent):
        with pytest.raises(WeightsStoreError, match=refusal):
            check_publishable(named)


def test_the_demo_bench_and_eval_refuse_a_cut_gguf_in_the_same_line(cut_file):
    path, refusal = cut_file
    for named in (path, path.parent):
        with pytest.raises(DemoError, match=refusal):
            resolve_demo_model(str(named))


def test_a_file_holding_all_its_tensors_bytes_is_no_truncation(source, tmp_path):
    whole = tmp_path / "whole.gguf"
    whole.write_bytes(source.read_bytes())
    assert checked_gguf_header(whole).split.tensors
    assert resolve_demo_model(str(whole)).num_layers == TINY_NUM_LAYERS
