"""Batched decode: one forward of a layer range for the one-token decode steps of several sessions, each keeping its
own KV cache and position.

How: the rows' hidden states are stacked into ``[B, 1, hidden]`` with per-row position ids, and each decoder layer
runs once for the batch. The layer's cache is a `RowCaches`: its ``update`` appends each row's new key/value to
that row's own session cache (the session's cache class does the appending and any sliding-window trimming, exactly
as in a solo step) and hands the layer the rows' keys/values left-padded to the longest and stacked. A 4-D mask
hides the padding: every row's keys end at its current position, so key column j of row i holds position
``pos_i - (width - 1 - j)``, and it is visible iff it is not padding (and, for sliding layers, inside the window).

Why per-session caches rather than one batched slot cache: sessions join and leave between steps without copying
anyone's cache, prefill stays the solo path, and eviction/accounting stay per session (inference/sessions.py).
The price is one concatenation per layer and row, small next to the batched projections.

Parity: the masked padding contributes exact zeros to attention, but batched matrix products may round differently
from one-row ones; the tests compare greedy tokens of batched and solo runs for every tiny architecture.
Only the ``sdpa`` and ``eager`` attention implementations are batched (their masks are the boolean / additive ones
built here); LayerRangeRunner runs other steps one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig

from .architectures import FULL_ATTENTION, SLIDING_ATTENTION
from .layer_call import run_decoder_layer

BATCHED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def batched_decode_supported(config: PretrainedConfig, attention_types: Sequence[str]) -> bool:
    """True when every layer's attention takes the masks built here."""
    return getattr(config, "_attn_implementation", None) in BATCHED_ATTENTION_IMPLEMENTATIONS and set(
        attention_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}


@dataclass(frozen=True)
class DecodeRow:
    """One session's decode step in a batch: its one-token hidden states ``[1, 1, hidden]`` at ``start_pos``."""

    session_id: str
    hidden_states: torch.Tensor
    start_pos: int


class RowCaches:
    """Stands in for a layer's KV cache argument across a batch: row i's keys/values live in ``caches[i]``."""

    def __init__(self, caches: Sequence[DynamicCache]) -> None:
        self.caches = list(caches)

    def stored_tokens(self, layer_index: int) -> list[int]:
        """Tokens each row's cache holds for one layer before this step (what a step attends besides itself)."""
        return [_stored(cache, layer_index) for cache in self.caches]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update_rows(self.caches, key_states, value_states, layer_idx, *args, **kwargs)
        width = max(k.shape[-2] for k in keys)
        return _left_padded(keys, width), _left_padded(values, width)


def update_rows(caches: Sequence, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
                **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row i's new key/value appended to caches[i] by that cache's own class; each row's keys and values after.

    Whatever else the layer passes (``cache_kwargs`` positionally in early transformers 5 releases, ``kwargs=`` in
    later ones) goes to each cache's own ``update`` as it came."""
    keys, values = [], []
    for row, cache in enumerate(caches):
        row_keys, row_values = cache.update(key_states[row:row + 1], value_states[row:row + 1], layer_idx, *args,
                                            **kwargs)
        keys.append(row_keys)
        values.append(row_values)
    return keys, values


def run_batched_decode(*, config: PretrainedConfig, layers: dict[int, nn.Module], rotary_embedding: nn.Module,
                       attention_types: Sequence[str], caches: Sequence[DynamicCache], hidden_states: torch.Tensor,
                       positions: Sequence[int], run_lo: int, run_hi: int) -> torch.Tensor:
    """Layers ``run_lo..run_hi`` for ``hidden_states`` ``[B, 1, hidden]``: row i at ``positions[i]`` of caches[i]."""
    rows = RowCaches(caches)
    position_ids = torch.tensor(list(positions), dtype=torch.long, device=hidden_states.device).view(-1, 1)
    position_embeddings = rotary_embedding(hidden_states, position_ids)
    window = getattr(config, "sliding_window", None)
    for layer_index in range(run_lo, run_hi + 1):
        sliding = attention_types[layer_index] == SLIDING_ATTENTION
        mask = _row_mask(rows.stored_tokens(layer_index), window if sliding else None, hidden_states, config)
        hidden_states = run_decoder_layer(layers[layer_index], hidden_states, attention_mask=mask,
                                          position_ids=position_ids, cache=rows,
                                          position_embeddings=position_embeddings)
    return hidden_states


def _stored(cache: DynamicCache, layer_index: int) -> int:
    layer = cache.layers[layer_index]
    keys = getattr(layer, "keys", None)
    return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def _left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """``[B, heads, width, dim]`` with row i's tokens at its right end (one copy per row, zeros before)."""
    first = tensors[0]
    stacked = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for row, tensor in enumerate(tensors):
        stacked[row, :, width - tensor.shape[-2]:] = tensor[0]
    return stacked


def _row_mask(stored: list[int], window: int | None, hidden_states: torch.Tensor,
              config: PretrainedConfig) -> torch.Tensor:
    """``[B, 1, 1, width]``: key column j of row i is visible iff it holds one of the row's keys (in the window)."""
    device = hidden_states.device
    lengths = torch.tensor([n + 1 for n in stored], device=device).view(-1, 1)
    width = max(stored) + 1
    # How many positions before the query each column lies (0 for the newest key, the step's own).
    distance = torch.arange(width - 1, -1, -1, device=device).view(1, -1)
    visible = distance < lengths
    if window is not None:
        visible &= distance < window
    visible = visible.view(len(stored), 1, 1, width)
    if config._attn_implementation == "sdpa":
        return visible
    zero = torch.zeros((), dtype=hidden_states.dtype, device=device)
    return torch.where(visible, zero, torch.finfo(hidden_states.dtype).min)
