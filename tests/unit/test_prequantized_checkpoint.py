"""A safetensors checkpoint stored quantized by another library (its config.json states a quantization_config: FP8,
GPTQ, AWQ, bitsandbytes) is refused in one line wherever hearth opens one: its Linear weights are codes whose scales
lie in tensors of their own, which hearth's reader used to serve as the weights themselves. Integer codes saved
without one are refused in one line too, where torch's copy into the model raised a multi-line error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.inference import load_head, load_layer_range
from hearth.inference.checkpoint import read_config_dict
from hearth.inference.errors import CheckpointError
from hearth.inference.hub_fetch import hub_layout
from hearth.inference.loading import check_checkpoint
from tests.runner_limits import RUNNER_KV_LIMITS
from tests.unit.inference_tiny_models import write_tiny_model

from .hub_server import fake_hub  # noqa: F401  (fixture)

FP8_MAX = 448.0


@pytest.fixture
def fp8_checkpoint(tmp_path):
    """A tiny llama whose layers' Linear weights are stored as FP8 codes with one scale each, as FP8 checkpoints
    (transformers' "fp8" quant_method) store them."""
    folder = write_tiny_model(tmp_path / "tiny-fp8", "llama")
    weights = folder / "model.safetensors"
    stored = {}
    for name, tensor in load_file(weights).items():
        if tensor.dim() == 2 and ".layers." in name:
            scale = tensor.abs().amax() / FP8_MAX
            stored[name] = (tensor / scale).to(torch.float8_e4m3fn)
            stored[name.replace(".weight", ".weight_scale_inv")] = scale.reshape(1, 1)
        else:
            stored[name] = tensor
    save_file(stored, str(weights), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_checkpoint_stored_quantized_is_refused_in_one_line_before_any_weight_is_read(fp8_checkpoint):
    for read in (lambda: check_checkpoint(fp8_checkpoint), lambda: read_config_dict(fp8_checkpoint),
                 lambda: load_layer_range(fp8_checkpoint, 0, 1, **RUNNER_KV_LIMITS),
                 lambda: load_head(fp8_checkpoint, load_tokenizer=False)):
        with pytest.raises(CheckpointError) as refusal:
            read()
        message = str(refusal.value)
        assert "\n" not in message and "tiny-fp8 is stored quantized (fp8 in its config.json)" in message, message


def test_a_hub_repository_stored_quantized_is_refused_while_sizing_from_its_headers(fake_hub, fp8_checkpoint):  # noqa: F811
    fake_hub.repos["tiny-org/tiny-fp8"] = fp8_checkpoint
    with pytest.raises(CheckpointError, match=r"^tiny-org/tiny-fp8 is stored quantized \(fp8 in its config.json\)"):
        hub_layout("tiny-org/tiny-fp8")
    assert not [name for name in fake_hub.downloaded("tiny-org/tiny-fp8") if name.endswith(".safetensors")]


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"])
def test_integer_codes_where_the_model_has_floats_are_refused_in_one_line(tmp_path, name):
    """Codes saved without a quantization_config: torch's state-dict copy raised a multi-line RuntimeError."""
    folder = write_tiny_model(tmp_path / "tiny-int8", "llama", with_tokenizer=False)
    weights = folder / "model.safetensors"
    stored = load_file(weights)
    stored[name] = (stored[name] * 100).to(torch.int8)
    save_file(stored, str(weights), metadata={"format": "pt"})
    load = (lambda: load_head(folder, load_tokenizer=False)) if "embed" in name else (
        lambda: load_layer_range(folder, 0, 0, quantization="int8", **RUNNER_KV_LIMITS))
    with pytest.raises(CheckpointError) as refusal:
        load()
    assert str(refusal.value) == (f"the checkpoint's {name} is stored as torch.int8, where the model's config makes "
                                  "it torch.float32")
