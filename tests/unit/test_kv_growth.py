"""KV caches that grow in place (hearth/inference/kv_growth.py): a growing layer holds exactly what transformers'
DynamicLayer holds through prefills, decode steps, crops and batch selections, writes a decode step into room it
kept (no copy of the cache) until a chunk is full, and a runner's steps over growing caches equal steps over
transformers' DynamicCache bit for bit, for every tiny architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer

from hearth.inference import load_head, load_layer_range
from hearth.inference.kv_growth import KV_GROWTH_POSITIONS, GrowingLayer, dynamic_cache_maker, growing_cache
from hearth.inference.sessions import kv_cache_bytes
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import ARCHITECTURES, TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401


def _states(tokens: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, tokens, 8), torch.randn(batch, 2, tokens, 8)


def _same(growing: GrowingLayer, reference: DynamicLayer) -> None:
    assert growing.get_seq_length() == reference.get_seq_length()
    assert torch.equal(growing.keys, reference.keys) and torch.equal(growing.values, reference.values)


def test_a_growing_layer_holds_what_a_dynamic_layer_holds_and_copies_once_a_chunk():
    torch.manual_seed(0)
    growing, reference = GrowingLayer(), DynamicLayer()
    for layer in (growing, reference):
        assert layer.get_seq_length() == 0
    prefill = _states(KV_GROWTH_POSITIONS + 3)
    for layer in (growing, reference):
        returned = layer.update(*prefill)
    assert torch.equal(returned[0], growing.keys)
    _same(growing, reference)

    buffer, new_buffers = growing.keys.data_ptr(), 0
    for _ in range(3 * KV_GROWTH_POSITIONS):
        step = _states(1)
        keys, values = growing.update(*step)
        reference.update(*step)
        _same(growing, reference)
        assert keys.shape[-2] == growing.get_seq_length()
        # Counted as changes from the buffer before: a freed buffer's address may be handed out again later, but
        # never to the buffer that replaces it (both are alive during the copy).
        new_buffers += keys.data_ptr() != buffer
        buffer = keys.data_ptr()
    # One new buffer per chunk filled, not one per step.
    assert new_buffers == 3
    held = growing.get_seq_length()
    assert held == 4 * KV_GROWTH_POSITIONS + 3
    assert kv_cache_bytes(_cache_of(growing), [0]) == 2 * held * 2 * 8 * 4  # the positions held, not the room kept

    after_crop = _states(2)
    for layer in (growing, reference):
        layer.crop(-5)
        layer.update(*after_crop)
    # The crop's 5 positions are overwritten in place with different states: the reference's copy agrees.
    _same(growing, reference)


def test_a_growing_layer_follows_a_batch_selection_and_a_reset():
    torch.manual_seed(1)
    growing, reference = GrowingLayer(), DynamicLayer()
    prefill = _states(5, batch=3)
    for layer in (growing, reference):
        layer.update(*prefill)
        layer.batch_select_indices(torch.tensor([0, 2]))
    step = _states(1, batch=2)
    for layer in (growing, reference):
        layer.update(*step)
    _same(growing, reference)
    growing.reset()
    assert growing.get_seq_length() == 0
    again = _states(4)
    growing.update(*again)
    assert torch.equal(growing.keys, again[0])


def _cache_of(layer: GrowingLayer) -> DynamicCache:
    cache = DynamicCache()
    cache.layers.append(layer)
    return cache


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_steps_over_growing_caches_equal_steps_over_dynamic_caches_bitwise(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    stack = runner._stack
    caches = {"growing": growing_cache(stack.config), "dynamic": DynamicCache(config=stack.config)}
    # Full-attention layers grow in place; sliding-window ones (all of the tiny mistral's) keep transformers' class.
    assert [isinstance(layer, GrowingLayer) for layer in caches["growing"].layers] == [
        type(layer) is DynamicLayer for layer in caches["dynamic"].layers]
    prompt = head.embed(head.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3))
    steps = [(prompt, 0)] + [(head.embed([7 + step]), prompt.shape[1] + step)
                             for step in range(KV_GROWTH_POSITIONS + 4)]
    with torch.inference_mode():
        for hidden, position in steps:
            outputs = {name: stack.layer_pass(cache, hidden, position, 0, TINY_NUM_LAYERS - 1).run()
                       for name, cache in caches.items()}
            assert torch.equal(outputs["growing"], outputs["dynamic"])


def test_sessions_caches_grow_in_place_on_the_cpu_only(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    make_on_cpu, grows_on_cpu = dynamic_cache_maker(config, torch.device("cpu"))
    make_on_gpu, grows_on_gpu = dynamic_cache_maker(config, torch.device("cuda"))

    assert grows_on_cpu and not grows_on_gpu
    assert all(isinstance(layer, GrowingLayer) for layer in make_on_cpu().layers)
    assert not any(isinstance(layer, GrowingLayer) for layer in make_on_gpu().layers)
