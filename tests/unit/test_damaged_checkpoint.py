"""A safetensors file that no longer reads (truncated by a full disk or a crash, damaged) is one CheckpointError line
naming it wherever hearth reads one: estimating a range's memory, loading layers, publishing to the store."""

from __future__ import annotations

import pytest

from hearth.inference import load_layer_range
from hearth.inference.errors import CheckpointError
from hearth.inference.memory import layer_weight_bytes
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.inference_tiny_models import write_tiny_model


@pytest.fixture
def damaged(tmp_path):
    folder = tmp_path / "tiny"
    write_tiny_model(folder, "llama")
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    return folder, weights


def test_a_truncated_weights_file_is_one_line_naming_it_when_estimated_or_loaded(damaged):
    import torch

    folder, weights = damaged
    for read in (lambda: layer_weight_bytes(folder, torch.float32),
                 lambda: load_layer_range(folder, 0, 1, **RUNNER_KV_LIMITS)):
        with pytest.raises(CheckpointError) as refused:
            read()
        message = str(refused.value)
        assert str(weights) in message and "no readable safetensors file" in message and "\n" not in message
