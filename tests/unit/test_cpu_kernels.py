"""The CPU linear kernels (hearth/inference/cpu_kernels.py): oneDNN runs batched decode steps by default while one
session's steps stay bitwise equal to transformers' modules; "onednn" runs every step on it; batched sessions give
their solo greedy tokens and the tokens torch's kernels give under every kernel; the swap shares the weights (no
extra memory), and the setting leaves layers it does not apply to alone."""

from __future__ import annotations

import typing

import pytest
import torch
from torch import nn

from hearth.inference import load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.cpu_kernels import (
    CPU_LINEAR_KERNELS,
    DEFAULT_CPU_LINEAR_KERNEL,
    OneDnnLinear,
    onednn_linear,
    onednn_linear_available,
    use_cpu_linear_kernel,
)
from hearth.services.common.config_processes import ShardSettings

from .inference_tiny_models import ARCHITECTURES, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_batched_decode import decode_eight_sessions_together, solo_tokens

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear operator")


def _linear_modes(runner) -> set[str]:
    return {f"{type(module).__name__}{'(batched only)' if getattr(module, 'batched_only', False) else ''}"
            for layer in runner._stack.layers.values() for module in layer.modules() if isinstance(module, nn.Linear)}


@pytest.mark.parametrize("kernel", ["onednn-batched", "onednn"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_onednn_layers_batch_eight_sessions_into_the_tokens_torch_s_kernels_give(tiny_model_dir, architecture,
                                                                                 kernel):
    path = tiny_model_dir(architecture)
    batch, solo = decode_eight_sessions_together(path, cpu_linear_kernel=kernel)
    expected = "OneDnnLinear(batched only)" if kernel == "onednn-batched" else "OneDnnLinear"
    assert _linear_modes(batch.runners[0]) == {expected}
    assert batch.tokens == solo
    head = load_head(path)
    torch_runners = [load_layer_range(path, 0, 2, cpu_linear_kernel="torch", **RUNNER_KV_LIMITS),
                     load_layer_range(path, 3, 5, cpu_linear_kernel="torch", **RUNNER_KV_LIMITS)]
    prompt_ids = head.encode_prompt("the quick brown fox")
    assert solo_tokens(batch.runners, head, prompt_ids) == solo_tokens(torch_runners, head, prompt_ids)


def test_batched_only_keeps_one_session_s_steps_bitwise_and_moves_batched_ones_to_onednn():
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    swapped = OneDnnLinear(dense, batched_only=True)
    everywhere = OneDnnLinear(dense, batched_only=False)
    assert swapped.weight is dense.weight and swapped.bias is dense.bias  # shared, not copied
    prefill, decode, batched = torch.randn(1, 7, 64), torch.randn(1, 1, 64), torch.randn(5, 1, 64)
    for one_session in (prefill, decode):
        assert torch.equal(swapped(one_session), dense(one_session))
    # Batched rows (and, for "onednn", every step) take oneDNN's product, equal to nn.Linear's within rounding.
    for module, inputs in ((swapped, batched), (everywhere, decode), (everywhere, batched)):
        assert torch.equal(module(inputs), onednn_linear(inputs, dense.weight, dense.bias))
        torch.testing.assert_close(module(inputs), dense(inputs))
    with torch.no_grad():
        dense.weight.add_(1.0)  # a later change of the shared weights is seen by the swapped module
    torch.testing.assert_close(swapped(batched), dense(batched))


def test_one_session_through_the_default_kernel_is_bitwise_equal_to_torch_s(tiny_model_dir):
    path = tiny_model_dir("llama")
    default = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    dense = load_layer_range(path, 0, 5, cpu_linear_kernel="torch", **RUNNER_KV_LIMITS)
    assert _linear_modes(default) == {"OneDnnLinear(batched only)"} and _linear_modes(dense) == {"Linear"}
    head = load_head(path)
    assert solo_tokens([default], head, head.encode_prompt("hello")) == solo_tokens([dense], head,
                                                                                  head.encode_prompt("hello"))
    states = head.embed(head.encode_prompt("hearth runs one model"))
    assert torch.equal(default.forward("a", states, 0, "prefill"), dense.forward("a", states, 0, "prefill"))


def test_the_swap_shares_the_weights(tiny_model_dir):
    path = tiny_model_dir("llama")
    dense, onednn = load_layer_range(path, 0, 5, cpu_linear_kernel="torch", **RUNNER_KV_LIMITS), load_layer_range(
        path, 0, 5, cpu_linear_kernel="onednn", **RUNNER_KV_LIMITS)
    assert dense.weight_bytes == onednn.weight_bytes


def test_the_setting_leaves_layers_it_does_not_apply_to_alone(tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("llama"), 0, 5, dtype="bf16", cpu_linear_kernel="onednn",
                              **RUNNER_KV_LIMITS)
    assert _linear_modes(runner) == {"Linear"}  # float32 layers only
    layer = nn.Sequential(nn.Linear(4, 4))
    assert not use_cpu_linear_kernel([layer], "torch", torch.device("cpu"), torch.float32)
    assert not use_cpu_linear_kernel([layer], "onednn", torch.device("meta"), torch.float32)
    assert type(layer[0]) is nn.Linear
    with pytest.raises(ValueError, match="cpu_linear_kernel must be one of torch, onednn-batched, onednn"):
        use_cpu_linear_kernel([layer], "fast", torch.device("cpu"), torch.float32)


def test_the_config_offers_the_kernels_the_code_knows_with_the_same_default():
    field = ShardSettings.model_fields["cpu_linear_kernel"]
    assert typing.get_args(field.annotation) == CPU_LINEAR_KERNELS
    assert field.default == DEFAULT_CPU_LINEAR_KERNEL
