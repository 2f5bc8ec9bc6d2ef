"""`hearth host` given a checkpoint that holds no weights of some layer (a download or conversion cut short) refuses
while planning, naming the layer: a layer that seemed to weigh nothing would be taken on for free, announced, and
then fail to load on every restart."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hearth.services.common.config import HearthSettings
from hearth.services.host.main import run_host
from hearth.services.shard.main import ShardRefused
from tests.unit.inference_tiny_models import tiny_model_dir  # noqa: F401  (a fixture)

UNREACHABLE = "nats://127.0.0.1:1"


def without_layer(source, target, layer: int):
    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: t for name, t in tensors.items() if f".layers.{layer}." not in name}, file,
                  metadata={"format": "pt"})
    return target


def test_a_checkpoint_missing_a_layers_weights_is_refused_naming_it(tiny_model_dir, tmp_path):  # noqa: F811
    folder = without_layer(tiny_model_dir("llama"), tmp_path / "cut", layer=1)
    with pytest.raises(ShardRefused) as refused:
        asyncio.run(run_host(model=str(folder), memory_budget_mb=None, nats_url=UNREACHABLE,
                             settings=HearthSettings(), node_id="n1", stop_event=asyncio.Event()))
    message = str(refused.value)
    assert "holds no weights of layer 1 (1 of its" in message and "an incomplete checkpoint" in message, message
    assert "\n" not in message
