"""`hearth host` given a GGUF with a decoder layer in a block type hearth does not read refuses while planning, from
the tensor table alone: its first line is the refusal, before any broker is reached or any range is announced."""

from __future__ import annotations

import asyncio

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from hearth.services.common.config import HearthSettings
from hearth.services.host.main import run_host
from hearth.services.shard.main import ShardRefused
from tests.unit.gguf_files import own_cache, rewrite_gguf, write_tiny_gguf  # noqa: F401  (a fixture)

MXFP4 = GGMLQuantizationType.MXFP4  # a block type gguf.quants knows and hearth does not read
UNREACHABLE = "nats://127.0.0.1:1"


def one_layer_tensor_in_mxfp4(tmp_path):
    source, _ = write_tiny_gguf(tmp_path, "llama", GGMLQuantizationType.F32)

    def rewrite(name: str, values: np.ndarray):
        if name != "blk.3.ffn_down.weight":
            return values, None
        return np.zeros(gguf.quant_shape_to_byte_shape(values.shape, MXFP4), dtype=np.uint8), MXFP4

    return rewrite_gguf(source, tmp_path / "mxfp4.gguf", "llama", rewrite)


def test_a_layer_in_a_block_type_hearth_does_not_read_is_refused_before_anything_is_announced(tmp_path, caplog):
    path = one_layer_tensor_in_mxfp4(tmp_path)
    with caplog.at_level("INFO"), pytest.raises(ShardRefused) as refused:
        asyncio.run(run_host(model=str(path), memory_budget_mb=None, nats_url=UNREACHABLE,
                             settings=HearthSettings(), node_id="n1", stop_event=asyncio.Event()))
    message = str(refused.value)
    assert message.startswith(f"cannot plan a range of {path}: tensor blk.3.ffn_down.weight of mxfp4.gguf is stored "
                              "as MXFP4, a GGUF type hearth does not read"), message
    assert "serving layers" not in caplog.text
