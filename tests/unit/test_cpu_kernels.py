"""The oneDNN linear kernel for CPU layer ranges (inference/cpu_kernels.py): the projections are swapped for
oneDNN's, batched sessions still give their solo greedy tokens and the same tokens as torch's kernels, the weights
are still counted, and the setting leaves layers it does not apply to alone."""

from __future__ import annotations

import pytest
import torch
import torch.utils.mkldnn
from torch import nn

from inference import load_head, load_layer_range
from inference.cpu_kernels import use_cpu_linear_kernel

from .inference_tiny_models import ARCHITECTURES, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_batched_decode import decode_eight_sessions_together, solo_tokens

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _linear_kinds(runner) -> set[str]:
    return {type(module).__name__ for layer in runner._layers.values() for module in layer.modules()
            if isinstance(module, nn.Linear | torch.utils.mkldnn.MkldnnLinear)}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_onednn_layers_batch_eight_sessions_into_the_tokens_torch_s_kernels_give(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    batch, solo = decode_eight_sessions_together(path, cpu_linear_kernel="onednn")
    assert _linear_kinds(batch.runners[0]) == {"MkldnnLinear"}
    assert batch.tokens == solo
    head = load_head(path)
    torch_runners = [load_layer_range(path, 0, 2), load_layer_range(path, 3, 5)]
    prompt_ids = head.encode_prompt("the quick brown fox")
    assert solo_tokens(batch.runners, head, prompt_ids) == solo_tokens(torch_runners, head, prompt_ids)


def test_onednn_weights_are_still_counted(tiny_model_dir):
    path = tiny_model_dir("llama")
    dense, onednn = load_layer_range(path, 0, 5), load_layer_range(path, 0, 5, cpu_linear_kernel="onednn")
    assert _linear_kinds(dense) == {"Linear"}
    # oneDNN's module adds a zero bias where the checkpoint has none: a few hundred bytes per projection.
    assert dense.weight_bytes <= onednn.weight_bytes <= dense.weight_bytes * 1.05


def test_the_setting_leaves_layers_it_does_not_apply_to_alone(tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("llama"), 0, 5, dtype="bf16", cpu_linear_kernel="onednn")
    assert _linear_kinds(runner) == {"Linear"}  # oneDNN's linear module is for float32 weights
    layer = nn.Sequential(nn.Linear(4, 4))
    assert not use_cpu_linear_kernel([layer], "torch", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="cpu_linear_kernel must be one of torch, onednn"):
        use_cpu_linear_kernel([layer], "fast", torch.device("cpu"), torch.float32)
