"""hearth's GGUF header parser (hearth/inference/gguf_header.py) given a real writer's header with bytes overwritten
(counts, lengths and type ids set to extremes among them) or cut short answers only as it says it does: a parsed
header, HeaderIncomplete asking for more than it was given, or one-line CheckpointError; never another exception,
and never by allocating what the damaged header declares."""

from __future__ import annotations

import struct

import pytest
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.inference import CheckpointError
from hearth.inference.gguf_header import HeaderIncomplete, parse_gguf_header
from hearth.inference.gguf_parts import split_gguf

from .gguf_files import write_tiny_gguf

EXTREMES = (0, 1, 7, 9, 63, 64, 1 << 31, (1 << 32) - 1, 1 << 62, (1 << 64) - 1)


@pytest.fixture(scope="module")
def header(tmp_path_factory) -> tuple[bytes, int]:
    """The leading bytes of a tiny llama GGUF up to its tensor data, and the whole file's size."""
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "llama", GGMLQuantizationType.Q4_1)
    data = path.read_bytes()
    return data[:split_gguf(path).header_bytes], len(data)


damage = st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(("byte", "u32", "u64")),
                            st.one_of(st.sampled_from(EXTREMES), st.integers(0, 255))), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=damage, cut=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_a_damaged_header_is_parsed_refused_in_one_line_or_asked_to_grow(header, damage, cut):
    buffer, file_size = header
    damaged = bytearray(buffer)
    for position, width, value in damage:
        at = position % len(damaged)
        encoded = {"byte": struct.pack("<B", value & 0xFF), "u32": struct.pack("<I", value & 0xFFFFFFFF),
                   "u64": struct.pack("<Q", value)}[width]
        damaged[at:at + len(encoded)] = encoded
    if cut is not None:
        damaged = damaged[:cut % (len(damaged) + 1)]
    try:
        parse_gguf_header(bytes(damaged), file_size, "fuzzed.gguf")
    except HeaderIncomplete as incomplete:
        assert incomplete.needed > len(damaged)
    except CheckpointError as refusal:
        assert "\n" not in str(refusal) and str(refusal).startswith(("fuzzed.gguf", "tensor ", "GGUF fuzzed.gguf"))
