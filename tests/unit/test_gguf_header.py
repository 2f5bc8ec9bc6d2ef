"""A GGUF header parsed from leading bytes alone: the same split as the whole file's, a short buffer answered with
how many bytes it needs, and a file hearth does not read refused in one line before any tensor byte is fetched."""

from __future__ import annotations

import struct

import pytest
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError
from hearth.inference.gguf_header import HeaderIncomplete, parse_gguf_header, read_gguf_header
from hearth.inference.gguf_layout import GGUFPartTensor
from hearth.inference.gguf_parts import split_gguf
from hearth.inference.hub_gguf import coalesced_spans

from .gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "llama", GGMLQuantizationType.Q4_1)
    return path


def test_the_header_parses_to_the_whole_files_split(tiny_gguf):
    data = tiny_gguf.read_bytes()
    split = split_gguf(tiny_gguf)
    parsed = parse_gguf_header(data[:split.header_bytes], len(data), tiny_gguf.name)
    assert parsed.split == split and parsed.architecture == "llama"


def test_a_short_buffer_says_how_many_bytes_it_needs(tiny_gguf):
    data = tiny_gguf.read_bytes()
    header_bytes = split_gguf(tiny_gguf).header_bytes
    # Cut anywhere: in the counts, a key, the vocabulary's strings (skipped undecoded), the tensor infos.
    for length in (0, 3, 20, *(header_bytes * twentieth // 20 for twentieth in range(1, 20)), header_bytes - 40):
        with pytest.raises(HeaderIncomplete) as short:
            parse_gguf_header(data[:length], len(data), tiny_gguf.name)
        assert length < short.value.needed <= header_bytes


@pytest.mark.parametrize(("change", "refusal"), [
    (lambda data: b"GGML" + data[4:], "no GGUF magic"),
    (lambda data: data[:4] + struct.pack(">I", 3) + data[8:], "little-endian GGUF versions 2 and 3"),
])
def test_a_file_hearth_does_not_read_is_refused_in_one_line(tiny_gguf, change, refusal):
    data = change(tiny_gguf.read_bytes())
    with pytest.raises(CheckpointError, match=refusal) as refused:
        parse_gguf_header(data, len(data), tiny_gguf.name)
    assert "\n" not in str(refused.value)


def test_a_file_shorter_than_its_tensor_table_says_is_refused_as_truncated(tiny_gguf):
    data = tiny_gguf.read_bytes()
    cut_short = rf"is truncated: its tensors need {len(data)} bytes, the file holds {len(data) - 1} \(re-download it\)$"
    with pytest.raises(CheckpointError, match=cut_short):
        parse_gguf_header(data, len(data) - 1, tiny_gguf.name)


def _tensor(start: int, n_bytes: int) -> GGUFPartTensor:
    return GGUFPartTensor(name=f"t{start}", layer=0, block_type="F32", shape=(n_bytes // 4,), info_start=0,
                          info_end=8, data_start=start, n_bytes=n_bytes)


def test_neighbouring_tensors_are_fetched_in_one_span_whatever_their_order():
    tensors = [_tensor(10_000, 100), _tensor(0, 64), _tensor(96, 32), _tensor(50_000, 8)]
    assert coalesced_spans(tensors) == [(0, 127), (10_000, 10_099), (50_000, 50_007)]


def _header_with_one_value(value: bytes) -> bytes:
    """A GGUF header whose one metadata value is `value` (its type id first) and which lists no tensor."""
    key = b"general.x"
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + value


def test_metadata_arrays_nested_past_the_bound_are_refused_in_one_line():
    depth = 2000
    nested = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    data = _header_with_one_value(nested)
    with pytest.raises(CheckpointError, match="metadata arrays nested deeper than") as refused:
        parse_gguf_header(data, len(data), "nested.gguf", check_tensors=False)
    assert "\n" not in str(refused.value)
    shallow = _header_with_one_value(struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2 + struct.pack("<IQ", 0, 0))
    assert parse_gguf_header(shallow, len(shallow), "shallow.gguf", check_tensors=False).metadata["general.x"] is None


def test_a_local_header_longer_than_the_bound_is_refused_without_reading_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr("hearth.inference.gguf_header.FIRST_HEADER_READ_BYTES", 1024)
    monkeypatch.setattr("hearth.inference.gguf_header.MAX_GGUF_HEADER_BYTES", 4096)
    long_string = _header_with_one_value(struct.pack("<IQ", 8, 1 << 20))  # a string of 1 MiB
    path = tmp_path / "long.gguf"
    path.write_bytes(long_string + bytes(2 << 20))
    with pytest.raises(CheckpointError, match="header is longer than 4096 bytes"):
        read_gguf_header(path)
    # A string of 2^62 bytes is corruption, not a cut: before, "truncated ... (re-download it)".
    path.write_bytes(_header_with_one_value(struct.pack("<IQ", 8, 1 << 62)) + bytes(8192))
    with pytest.raises(CheckpointError, match=r"header is longer than 4096 bytes \(it states at least \d+\), "
                                              r"hearth's bound on a GGUF header: corrupt"):
        read_gguf_header(path)
    path.write_bytes(_header_with_one_value(struct.pack("<IQ", 8, 3000)) + bytes(2000))  # a string cut short
    cut_short = r"long.gguf is truncated: its header needs at least 3053 bytes, the file holds 2053 \(re-download it\)$"
    with pytest.raises(CheckpointError, match=cut_short):
        read_gguf_header(path)
    with pytest.raises(CheckpointError, match="unknown type 99"):
        path.write_bytes(_header_with_one_value(struct.pack("<I", 99)) + bytes(64))
        read_gguf_header(path)


def _tensor_info(name: bytes, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", dim) for dim in dims) + struct.pack("<IQ", type_id, offset))


@pytest.mark.parametrize(("infos", "why"), [
    ([_tensor_info(b"", [1] * 9)], "tensor #0 (unnamed) has 9 dimensions"),
    ([_tensor_info(b"token_embd.weight", [32]), _tensor_info(b"", [3], GGMLQuantizationType.Q4_0, 128)],
     "tensor #1 (unnamed)'s rows of 3 values are no whole number of Q4_0 blocks of 32"),
    ([_tensor_info(b"token_embd.weight", [32]), _tensor_info(b"", [32], offset=8)],
     "tensor #1 (unnamed)'s data offset 8 is not a multiple of the file's alignment 32"),
], ids=["dimensions", "blocks", "alignment"])
def test_a_tensor_with_an_empty_name_is_refused_by_its_index(infos, why):
    """Before, such a refusal read "tensor  has 9 dimensions": two spaces, no tensor named."""
    data = b"GGUF" + struct.pack("<IQQ", 3, len(infos), 0) + b"".join(infos)
    with pytest.raises(CheckpointError) as refused:
        parse_gguf_header(data + bytes(256), len(data) + 256, "unnamed.gguf", check_tensors=False)
    assert why in str(refused.value) and "tensor  " not in str(refused.value), str(refused.value)
