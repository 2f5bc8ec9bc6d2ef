"""Batched steps: one forward of a layer range for the steps of several sessions (decode steps of one token, and
prefills of a few tokens each), each session keeping its own KV cache and position.

How: the rows' hidden states are stacked into ``[B, T, hidden]``, T the most tokens any row brings, each row's tokens
at the right end (left-padded), with per-row position ids, and each decoder layer runs once for the batch. The
layer's cache is a `RowCaches`: its ``update`` appends each row's new keys/values (not its padding) to that row's own
session cache (the session's cache class does the appending and any sliding-window trimming, exactly as in a solo
step) and hands the layer the rows' keys/values left-padded to the longest and stacked. So every row's keys end in
the last column, and query column q of every row sits at key column ``width - T + q``: a 4-D mask shows each of a
row's queries its own keys up to its position (and, for sliding layers, inside the window), never padding. A padding
query sees only the key column it sits at, so no softmax row is empty (its output is dropped).

Why per-session caches rather than one batched slot cache: sessions join and leave between steps without copying
anyone's cache, and eviction/accounting stay per session (hearth/inference/sessions.py). Stacked, the price is one copy
per layer of every row's keys and values into the stacked tensors. Those are written into `StackingBuffers` that the
runner keeps from step to step, and only each row's padding is zeroed: a fresh zero-filled tensor per layer cost more
than the batched projections at a few hundred tokens of context (freshly mapped pages faulted in, then written twice;
BENCHMARKS.md, "Batched steps at long contexts"). A CPU layer range that attends through SDPA copies nothing: it is
loaded under hearth/inference/row_attention.py's implementation, and each row attends its own cache's keys and values
under the mask its solo step builds (transformers' own builder, against the row's cache as the step found it), while
the projections stay one product for the batch.

Parity: masked keys contribute exact zeros to attention, but batched matrix products may round differently from
one-row ones; the tests compare greedy tokens of batched and solo runs for every tiny architecture. A row's padding
changes nothing of its real tokens' results beyond that rounding (it is masked from them). Attended row by row, a row's
attention is its solo step's, so where the projections are exact per row (int8, int4) a batched row is bitwise its solo
step. Only the ``sdpa`` (and row-wise SDPA) and ``eager`` attention implementations are batched (their masks are the
boolean / additive ones built here); LayerRangeRunner runs other steps one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig

from .architectures import FULL_ATTENTION, SLIDING_ATTENTION
from .layer_call import longer_extent, position_embeddings_by_type, run_decoder_layer
from .layer_pass import DecoderStack, step_masks
from .row_attention import SDPA_IMPLEMENTATIONS, attends_by_row

BATCHED_ATTENTION_IMPLEMENTATIONS = (*SDPA_IMPLEMENTATIONS, "eager")


def batched_steps_supported(config: PretrainedConfig, attention_types: Sequence[str]) -> bool:
    """True when every layer's attention takes the masks built here."""
    return getattr(config, "_attn_implementation", None) in BATCHED_ATTENTION_IMPLEMENTATIONS and set(
        attention_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}


@dataclass(frozen=True)
class BatchRow:
    """One session's step in a batch: its hidden states ``[1, T, hidden]`` for positions ``start_pos..+T-1``; a
    ``prefill`` at ``start_pos`` 0 starts the session (as in a solo step); ``prompt_tokens``: the length of the prompt
    a prefill is a chunk of (LayerRangeRunner.forward)."""

    session_id: str
    hidden_states: torch.Tensor
    start_pos: int
    kind: str = "decode"
    prompt_tokens: int | None = None


class StackingBuffers:
    """Storage, reused from step to step, for the left-padded keys and values of a batched layer's attention.

    Each layer's stacked keys/values are read by that layer's attention only, so every layer of every step reuses the
    same two buffers; they grow to the largest batch seen (one layer's keys and values of it) and are never shrunk.
    Callers serialise their steps (the runner's lock)."""

    KEYS, VALUES = 0, 1
    # Room for this many times the elements asked when a buffer grows: contexts grow a token per step.
    growth_factor = 1.5

    def __init__(self) -> None:
        self._storage: list[torch.Tensor | None] = [None, None]

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self._storage if flat is not None)

    def left_padded(self, slot: int, tensors: list[torch.Tensor], width: int) -> torch.Tensor:
        """As `_left_padded`, into the slot's buffer: a contiguous ``[B, ..., width, dim]`` view of it, valid until
        the slot is asked again."""
        first = tensors[0]
        shape = (len(tensors), *first.shape[1:-2], width, first.shape[-1])
        elements = math.prod(shape)
        flat = self._storage[slot]
        if flat is None or flat.numel() < elements or flat.dtype != first.dtype or flat.device != first.device:
            flat = first.new_empty(int(elements * self.growth_factor))
            self._storage[slot] = flat
        stacked = flat[:elements].view(shape)
        for row, tensor in enumerate(tensors):
            padding = width - tensor.shape[-2]
            if padding:
                stacked[row, ..., :padding, :].zero_()  # masked, but must be finite: 0 x NaN would leak into rows
            stacked[row, ..., padding:, :] = tensor[0]
        return stacked


class RowCaches:
    """Stands in for a layer's KV cache argument across a batch: row i's keys/values live in ``caches[i]``.

    With ``row_masks`` (per row, its solo step's mask per attention type) the rows are attended one by one
    (hearth/inference/row_attention.py): `update` keeps each row's keys and values for the layer's attention and
    stacks nothing."""

    def __init__(self, caches: Sequence[DynamicCache], new_tokens: Sequence[int],
                 buffers: StackingBuffers | None = None, *, row_masks: list[dict[str, object]] | None = None,
                 attention_types: Sequence[str] = ()) -> None:
        self.caches = list(caches)
        self.new_tokens = list(new_tokens)
        self.buffers = buffers if buffers is not None else StackingBuffers()
        self.row_masks = row_masks
        self._attention_types = attention_types
        self._updated: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None

    def stored_tokens(self, layer_index: int) -> list[int]:
        """Tokens each row's cache holds for one layer before this step (what a step attends besides itself)."""
        return [_stored(cache, layer_index) for cache in self.caches]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update_rows(self.caches, self._real_tokens(key_states), self._real_tokens(value_states),
                                   layer_idx, *args, **kwargs)
        if self.row_masks is not None:
            self._updated = (layer_idx, keys, values)
            return key_states, value_states  # the attention reads row_attention_inputs instead
        width = max(k.shape[-2] for k in keys)
        return (self.buffers.left_padded(StackingBuffers.KEYS, keys, width),
                self.buffers.left_padded(StackingBuffers.VALUES, values, width))

    def row_attention_inputs(self, row: int, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Row's keys and values after this layer's update, and the mask its solo step has for the layer."""
        if self._updated is None or self._updated[0] != layer_index or self.row_masks is None:
            raise RuntimeError(f"layer {layer_index} attends by row before its rows' caches were updated")
        _, keys, values = self._updated
        return keys[row], values[row], self.row_masks[row][self._attention_types[layer_index]]

    def _real_tokens(self, states: torch.Tensor) -> list[torch.Tensor]:
        """Row i's ``[1, heads, T_i, dim]``: its own tokens' states, without the padding on their left."""
        width = states.shape[-2]
        return [states[row:row + 1, :, width - tokens:] for row, tokens in enumerate(self.new_tokens)]


def update_rows(caches: Sequence, key_states: Sequence[torch.Tensor], value_states: Sequence[torch.Tensor],
                layer_idx: int, *args, **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row i's new keys/values (``key_states[i]``, ``[1, heads, T_i, dim]``) appended to caches[i] by that cache's
    own class; each row's keys and values after.

    Whatever else the layer passes (``cache_kwargs`` positionally in early transformers 5 releases, ``kwargs=`` in
    later ones) goes to each cache's own ``update`` as it came."""
    keys, values = [], []
    for row, cache in enumerate(caches):
        row_keys, row_values = cache.update(key_states[row], value_states[row], layer_idx, *args, **kwargs)
        keys.append(row_keys)
        values.append(row_values)
    return keys, values


def run_batched_step(*, stack: DecoderStack, caches: Sequence[DynamicCache], hidden_states: Sequence[torch.Tensor],
                     positions: Sequence[int], run_lo: int, run_hi: int,
                     buffers: StackingBuffers | None = None,
                     extents: Sequence[int | None] | None = None) -> list[torch.Tensor]:
    """Layers ``run_lo..run_hi`` of `stack` for row i's ``hidden_states[i]`` ``[1, T_i, hidden]`` at ``positions[i]``
    of caches[i] (rotated as a sequence of ``extents[i]`` tokens where given, layer_call); row i's output ``[1, T_i,
    hidden]`` per row. ``buffers``: the caller's, kept between its steps. Call
    under the stack's lock. Rows of one token each that attend by row run on the stack's lean path where it has one
    (hearth/inference/lean_decode.py: each row attends its own cache, as below)."""
    config, layers, attention_types = stack.config, stack.layers, stack.attention_types
    new_tokens = [states.shape[1] for states in hidden_states]
    most = max(new_tokens)
    stacked = _left_padded(list(hidden_states), most)
    device = stacked.device
    # Padding columns take the positions before the row's first (clamped at 0): any valid ones do, nothing sees them.
    padding = torch.tensor([most - tokens for tokens in new_tokens], device=device).view(-1, 1)
    position_ids = (torch.tensor(list(positions), device=device).view(-1, 1) - padding
                    + torch.arange(most, device=device).view(1, -1)).clamp(min=0)
    row_extents = [longer_extent(extent, position, tokens)
                   for extent, position, tokens in zip(extents or [None] * len(positions), positions, new_tokens,
                                                       strict=True)]
    position_embeddings = position_embeddings_by_type(stack.rotary_embedding, stacked, position_ids,
                                                      attention_types[run_lo:run_hi + 1], row_extents)
    by_row = attends_by_row(config)
    lean = stack.lean.decoder() if stack.lean is not None and most == 1 and by_row else None
    if lean is not None:
        factors = lean.factors(next(iter(position_embeddings.values())))
        for layer_index in range(run_lo, run_hi + 1):
            stacked = lean.run_layer(layer_index, stacked, caches, factors)
        return [stacked[row:row + 1] for row in range(len(caches))]
    if by_row:
        rows = RowCaches(caches, new_tokens, row_masks=_solo_masks(config, attention_types, caches, hidden_states,
                                                                   positions, run_lo, run_hi),
                         attention_types=attention_types)
        for layer_index in range(run_lo, run_hi + 1):
            stacked = run_decoder_layer(
                layers[layer_index], stacked, attention_mask=None, position_ids=position_ids, cache=rows,
                position_embeddings=position_embeddings[attention_types[layer_index]], hearth_rows=rows)
        return [stacked[row:row + 1, most - tokens:] for row, tokens in enumerate(new_tokens)]
    rows = RowCaches(caches, new_tokens, buffers)
    window = getattr(config, "sliding_window", None)
    for layer_index in range(run_lo, run_hi + 1):
        sliding = attention_types[layer_index] == SLIDING_ATTENTION
        mask = _row_mask(rows.stored_tokens(layer_index), new_tokens, window if sliding else None, stacked, config)
        stacked = run_decoder_layer(layers[layer_index], stacked, attention_mask=mask, position_ids=position_ids,
                                    cache=rows, position_embeddings=position_embeddings[attention_types[layer_index]])
    return [stacked[row:row + 1, most - tokens:] for row, tokens in enumerate(new_tokens)]


def _solo_masks(config: PretrainedConfig, attention_types: Sequence[str], caches: Sequence[DynamicCache],
                hidden_states: Sequence[torch.Tensor], positions: Sequence[int], run_lo: int,
                run_hi: int) -> list[dict[str, object]]:
    """Per row, the masks its solo step builds (hearth/inference/layer_pass.py's `step_masks`)."""
    return [step_masks(config, attention_types, cache, states,
                       torch.arange(start, start + states.shape[1], device=states.device).unsqueeze(0), run_lo, run_hi)
            for cache, states, start in zip(caches, hidden_states, positions, strict=True)]


def _stored(cache: DynamicCache, layer_index: int) -> int:
    layer = cache.layers[layer_index]
    keys = getattr(layer, "keys", None)
    return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def _left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Rows ``[1, ..., T_i, dim]`` (keys/values ``[1, heads, T_i, dim]``, hidden states ``[1, T_i, hidden]``) stacked
    into ``[B, ..., width, dim]``, row i's tokens at its right end (one copy per row, zeros before)."""
    first = tensors[0]
    stacked = first.new_zeros((len(tensors), *first.shape[1:-2], width, first.shape[-1]))
    for row, tensor in enumerate(tensors):
        stacked[row, ..., width - tensor.shape[-2]:, :] = tensor[0]
    return stacked


def _row_mask(stored: list[int], new_tokens: list[int], window: int | None, hidden_states: torch.Tensor,
              config: PretrainedConfig) -> torch.Tensor:
    """``[B, 1, T, width]``: key column j is visible to query column q of row i iff it holds one of the row's keys
    at or before that query's position (in the window); a padding query sees only its own column."""
    device = hidden_states.device
    most = max(new_tokens)
    width = max(n + t for n, t in zip(stored, new_tokens, strict=True))
    query = torch.arange(most, device=device).view(1, most, 1)
    # How many positions before query q each key column lies (0: the query's own key).
    distance = (width - most + query) - torch.arange(width, device=device).view(1, 1, width)
    stored_t = torch.tensor(stored, device=device).view(-1, 1, 1)
    tokens_t = torch.tensor(new_tokens, device=device).view(-1, 1, 1)
    # Query q of row i is its token q - (T - T_i); it sees the row's stored keys and its new ones up to itself.
    seen = stored_t + tokens_t - (most - 1 - query)
    real_query = query >= most - tokens_t
    visible = (distance >= 0) & (distance < seen)
    if window is not None:
        visible &= distance < window
    visible = torch.where(real_query, visible, distance == 0).view(len(stored), 1, most, width)
    if config._attn_implementation in SDPA_IMPLEMENTATIONS:
        return visible
    zero = torch.zeros((), dtype=hidden_states.dtype, device=device)
    return torch.where(visible, zero, torch.finfo(hidden_states.dtype).min)
