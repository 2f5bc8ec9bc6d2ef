"""KV caches that grow in place: a session's full-attention keys and values live at the start of buffers with room
for more positions, so a decode step writes its one position instead of copying the whole cache.

Why: transformers' `DynamicLayer` joins the cached keys and the new ones into a fresh tensor at every step, so a
decode step copies every cached position of every layer (twice, keys and values), and at a few hundred positions
that copy costs a CPU shard about as much as its attention (BENCHMARKS.md, "KV caches that grow in place"). Here
the buffers grow by whole chunks of `KV_GROWTH_POSITIONS`: one copy of the cache per chunk of decode steps. Readers
see what a `DynamicLayer` shows them: `keys` and `values` hold exactly the cached positions (views of the buffers'
first positions), so cropping, snapshots of kept prefixes and the batched steps' stacking work unchanged. A cache's
bytes against the KV budget (hearth/inference/sessions.py) count the positions held, not the room kept for the next
ones: at most one chunk a layer, so the chunk is small.
Sliding-window layers keep transformers' own class (their cache never outgrows the window), and so does every
layer on a GPU, where this was not measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

# Positions a full layer's buffers grow by when full: the copy of the cache is paid once per this many decode steps,
# and at most this many positions a layer are held in reserve.
KV_GROWTH_POSITIONS = 16
# Devices whose sessions' dynamic caches grow in place (where it was measured).
GROWING_CACHE_DEVICE_TYPES = ("cpu",)


def dynamic_cache_maker(config: PretrainedConfig, device: torch.device) -> tuple[Callable[[], DynamicCache], bool]:
    """What makes a session's dynamic cache on `device`, and whether it grows in place: on the CPU, where that (and
    the lean one-token path over it) is measured (BENCHMARKS.md, "KV caches that grow in place"); elsewhere (a GPU's
    tests and local fallback) transformers' own DynamicCache."""
    if device.type in GROWING_CACHE_DEVICE_TYPES:
        return (lambda: growing_cache(config)), True
    return (lambda: DynamicCache(config=config)), False


def growing_cache(config: PretrainedConfig) -> DynamicCache:
    """transformers' DynamicCache for ``config`` with every full-attention layer a `GrowingLayer`."""
    cache = DynamicCache(config=config)
    cache.layers[:] = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` are views of the first positions of larger buffers."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        total = held + key_states.shape[-2]
        if not self._views_fit(held, total, key_states, value_states):
            self._grow(held, total, key_states, value_states)
        self._key_buffer[..., held:total, :].copy_(key_states)
        self._value_buffer[..., held:total, :].copy_(value_states)
        self.keys = self._key_buffer[..., :total, :]
        self.values = self._value_buffer[..., :total, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def _views_fit(self, held: int, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether `keys`/`values` are still the buffers' first positions (nothing replaced them: a batch selection
        or repetition makes new tensors) and the buffers have room for ``total`` positions of these states."""
        if self._key_buffer is None:  # set together with the value buffer
            return False
        for buffer, states, cached in ((self._key_buffer, key_states, self.keys),
                                       (self._value_buffer, value_states, self.values)):
            if (buffer.shape[-2] < total or buffer.shape[:-2] != states.shape[:-2]
                    or buffer.shape[-1] != states.shape[-1] or buffer.dtype != states.dtype
                    or buffer.device != states.device):
                return False
            if held and (cached.data_ptr() != buffer.data_ptr() or cached.stride() != buffer.stride()):
                return False
        return True

    def _grow(self, held: int, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers with room for ``total`` positions rounded up to whole chunks, holding the cached ones."""
        capacity = -(-total // KV_GROWTH_POSITIONS) * KV_GROWTH_POSITIONS
        grown = []
        for states, cached in ((key_states, self.keys), (value_states, self.values)):
            buffer = states.new_empty((*states.shape[:-2], capacity, states.shape[-1]))
            if held:
                buffer[..., :held, :].copy_(cached)
            grown.append(buffer)
        self._key_buffer, self._value_buffer = grown
