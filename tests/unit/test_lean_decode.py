"""One-token steps on the lean path (hearth/inference/lean_decode.py): taken for Llama-style layers on full attention
only, bitwise equal to transformers' modules for every scheme (outputs and cached keys and values), and refused at
load when a layer computes otherwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from hearth.inference import load_layer_range
from hearth.inference.batched import run_batched_step
from hearth.inference.kv_growth import growing_cache
from hearth.inference.lean_decode import LeanSlot, verified_lean_decoder
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

LAST_LAYER = TINY_NUM_LAYERS - 1
PROMPT_TOKENS, DECODE_STEPS = 5, 12


@pytest.mark.parametrize("architecture,overrides,layers,lean", [
    ("llama", {}, (0, LAST_LAYER), True),
    ("llama", {}, (2, 3), True),
    ("qwen2", {}, (0, 2), True),  # its first 3 layers attend fully, the others through a sliding window
    ("qwen2", {}, (2, 4), False),
    ("mistral", {"sliding_window": None}, (0, LAST_LAYER), True),
    ("mistral", {}, (0, LAST_LAYER), False),
    ("gemma2", {}, (0, LAST_LAYER), False),
    ("phi3", {}, (0, LAST_LAYER), False),
    ("qwen3", {}, (0, LAST_LAYER), False),
])
def test_one_token_steps_run_lean_for_llama_style_layers_on_full_attention_only(tiny_model_dir, architecture,
                                                                                overrides, layers, lean):
    runner = load_layer_range(tiny_model_dir(architecture, **overrides), *layers, **RUNNER_KV_LIMITS)
    assert runner.lean_decode is lean


@pytest.mark.parametrize("quantization", ["none", "int8", "int4/g32"])
@pytest.mark.parametrize("architecture,overrides,layers", [
    ("llama", {}, (0, LAST_LAYER)),
    ("qwen2", {}, (0, 2)),  # biased q, k and v: int8 runs them on their own products
    ("mistral", {"sliding_window": None}, (1, 4)),
])
def test_lean_steps_equal_transformers_modules_bitwise(tiny_model_dir, architecture, overrides, layers,
                                                        quantization):
    runner = load_layer_range(tiny_model_dir(architecture, **overrides), *layers, quantization=quantization,
                              **RUNNER_KV_LIMITS)
    assert runner.lean_decode
    stack = runner._stack
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(1, PROMPT_TOKENS + DECODE_STEPS, stack.config.hidden_size, generator=generator)
    lean_cache, module_cache = growing_cache(stack.config), growing_cache(stack.config)
    with torch.inference_mode():
        for cache in (lean_cache, module_cache):
            stack.layer_pass(cache, inputs[:, :PROMPT_TOKENS], 0, *layers).run()
        for position in range(PROMPT_TOKENS, PROMPT_TOKENS + DECODE_STEPS):
            token = inputs[:, position:position + 1]
            lean_output = stack.layer_pass(lean_cache, token, position, *layers).run()
            module_output = stack.layer_pass(module_cache, token, position, *layers, lean=False).run()
            assert torch.equal(lean_output, module_output), f"step at position {position}"
    for index in range(layers[0], layers[1] + 1):
        assert torch.equal(lean_cache.layers[index].keys, module_cache.layers[index].keys)
        assert torch.equal(lean_cache.layers[index].values, module_cache.layers[index].values)


class _ScaledOutputLayer(LlamaDecoderLayer):
    """A Llama layer that computes a little otherwise than Llama's (as a later transformers release might)."""

    def forward(self, hidden_states, cache=None, **keywords):
        return super().forward(hidden_states, cache=cache, **keywords) * 1.001


def test_a_layer_that_computes_otherwise_keeps_transformers_modules(tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("llama"), 0, 1, **RUNNER_KV_LIMITS)
    stack = runner._stack
    original = stack.layers[1]
    config = LlamaConfig(**stack.config.to_dict())
    config._attn_implementation = stack.config._attn_implementation
    altered = _ScaledOutputLayer(config, 1)
    altered.load_state_dict(original.state_dict())
    assert verified_lean_decoder(stack, lambda: growing_cache(stack.config)) is not None
    altered_stack = type(stack)(config=stack.config, layers={0: stack.layers[0], 1: altered},
                                rotary_embedding=stack.rotary_embedding, attention_types=stack.attention_types,
                                rotary_lock=stack.rotary_lock)
    assert verified_lean_decoder(altered_stack, lambda: growing_cache(stack.config)) is None


def test_a_check_that_fails_leaves_the_modules_in_charge_and_runs_once(caplog):
    calls = []

    def failing_check():
        calls.append(1)
        raise RuntimeError("no scratch cache here")

    slot = LeanSlot(failing_check)
    assert slot.decoder() is None and slot.decoder() is None
    assert calls == [1]
    assert "check failed" in caplog.text


@pytest.mark.parametrize("quantization", ["none", "int8", "int4/g32"])
def test_batched_one_token_steps_on_the_lean_path_equal_the_modules_bitwise(tiny_model_dir, quantization):
    """Three sessions of different lengths decoding together: each row attends its own cache on both paths."""
    runner = load_layer_range(tiny_model_dir("llama"), 0, LAST_LAYER, quantization=quantization, **RUNNER_KV_LIMITS)
    assert runner.lean_decode
    lean_stack = runner._stack
    module_stack = dataclasses.replace(lean_stack, lean=None)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randn(1, tokens, lean_stack.config.hidden_size, generator=generator) for tokens in (3, 7, 5)]
    outputs = {}
    for name, stack in (("lean", lean_stack), ("modules", module_stack)):
        caches = [growing_cache(stack.config) for _ in prompts]
        positions = [prompt.shape[1] for prompt in prompts]
        steps = []
        with torch.inference_mode(), stack.rotary_lock:
            for cache, prompt in zip(caches, prompts, strict=True):
                stack.layer_pass(cache, prompt, 0, 0, LAST_LAYER).run()
            for step in range(DECODE_STEPS):
                tokens = [torch.randn(1, 1, stack.config.hidden_size, generator=torch.Generator().manual_seed(step))
                          for _ in prompts]
                steps.append(run_batched_step(stack=stack, caches=caches, hidden_states=tokens,
                                              positions=[position + step for position in positions], run_lo=0,
                                              run_hi=LAST_LAYER))
        outputs[name] = (steps, caches)
    for step, (lean_rows, module_rows) in enumerate(zip(outputs["lean"][0], outputs["modules"][0], strict=True)):
        for row, (lean_row, module_row) in enumerate(zip(lean_rows, module_rows, strict=True)):
            assert torch.equal(lean_row, module_row), f"step {step}, row {row}"
    for lean_cache, module_cache in zip(outputs["lean"][1], outputs["modules"][1], strict=True):
        for index in range(TINY_NUM_LAYERS):
            assert torch.equal(lean_cache.layers[index].keys, module_cache.layers[index].keys)
            assert torch.equal(lean_cache.layers[index].values, module_cache.layers[index].values)
