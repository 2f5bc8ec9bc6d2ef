"""Calls into transformers' public decoder layers and mask builders, passing the KV cache under the name the
installed release gives it (``past_key_values`` in earlier 5.x releases, ``cache`` in later ones such as 5.24, which
keep the old name as a deprecated alias until 5.40), so every release in pyproject's range runs without warnings."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

NEW_CACHE_ARGUMENT = "cache"
OLD_CACHE_ARGUMENT = "past_key_values"
LAYER_TYPE_ARGUMENT = "layer_type"
# RoPE types whose frequencies transformers picks by the largest position of a call (LongRoPE's short or long
# factors), so rows of different sessions must not share a call and a piece of a sequence must say its length.
LENGTH_PICKED_ROPE_TYPES = ("longrope",)


@functools.cache
def cache_argument(function: Callable) -> str:
    """The keyword under which `function` takes the KV cache (its signature as the release declares it; the
    deprecation decorator keeps that signature visible through ``__wrapped__``)."""
    return NEW_CACHE_ARGUMENT if NEW_CACHE_ARGUMENT in inspect.signature(function).parameters else OLD_CACHE_ARGUMENT


def run_decoder_layer(layer: nn.Module, hidden_states: torch.Tensor, *, attention_mask: object,
                      position_ids: torch.Tensor, cache: object,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor], **attention_arguments: object,
                      ) -> torch.Tensor:
    """One decoder layer's forward; its hidden states out (some classes return a tuple, some a tensor).
    ``attention_arguments`` reach the layer's attention function (transformers passes a layer's extra keywords on)."""
    output = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                   position_embeddings=position_embeddings, **{cache_argument(type(layer).forward): cache},
                   **attention_arguments)
    return output[0] if isinstance(output, tuple) else output


def position_embeddings_by_type(rotary_embedding: nn.Module, hidden_states: torch.Tensor,
                                position_ids: torch.Tensor, attention_types: Sequence[str],
                                extents: Sequence[int | None] | None = None, as_decoded: bool = False,
                                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A step's rotary (cos, sin) for each attention type among `attention_types`: one per type where the model's
    rotary embedding takes the layer's type (Gemma 3 rotates local and global layers on different bases), the same
    one for every type otherwise.

    Where the embedding picks its frequencies by the length of what it rotates (LongRoPE: its short factors up to the
    original context, its long ones past it, by the largest position of the call), each row of a batch is rotated on
    its own, as that session's step alone would be, and a row whose ``extents`` entry is given takes the factors of a
    sequence that long (at least): the whole step's, or the whole prompt's, when it rotates only a piece of one. With
    ``as_decoded`` (a replay step, tokens decoded one by one and prefilled again) each position takes the factors its
    own decode step took instead: those of its own length."""
    if _takes_layer_type(type(rotary_embedding).forward):
        return {kind: _rotated_rows(rotary_embedding, hidden_states, position_ids, kind, extents, as_decoded)
                for kind in dict.fromkeys(attention_types)}
    shared = _rotated_rows(rotary_embedding, hidden_states, position_ids, None, extents, as_decoded)
    return {kind: shared for kind in attention_types}


def longer_extent(extent: int | None, start_pos: int, num_tokens: int) -> int | None:
    """`extent` where it reaches past the end of a step's tokens (positions ``start_pos..+num_tokens-1``), else None:
    a step alone rotates as long as it is."""
    return extent if extent is not None and extent > start_pos + num_tokens else None


def _rotated_rows(rotary_embedding: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                  layer_type: str | None, extents: Sequence[int | None] | None, as_decoded: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    arguments = () if layer_type is None else (layer_type,)
    batch = position_ids.shape[0]
    if _rope_type(rotary_embedding, layer_type) not in LENGTH_PICKED_ROPE_TYPES or (
            batch == 1 and not as_decoded and (extents is None or extents[0] is None)):
        return rotary_embedding(hidden_states, position_ids, *arguments)
    if as_decoded:  # a replay step: one session's, never batched
        return _rotated_as_decoded(rotary_embedding, hidden_states, position_ids, arguments)
    rows = []
    for row in range(batch):
        row_ids = position_ids[row:row + 1]
        extent = extents[row] if extents is not None else None
        if extent is not None:
            # One more position, the sequence's last, makes the call pick that length's factors; its row is dropped.
            row_ids = torch.cat([row_ids, row_ids.new_full((1, 1), extent - 1)], dim=1)
        cos, sin = rotary_embedding(hidden_states[row:row + 1], row_ids, *arguments)
        rows.append((cos, sin) if extent is None else (cos[:, :-1], sin[:, :-1]))
    # No positions read on the host: the calls stay capturable in a CUDA graph.
    return torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])


def _rotated_as_decoded(rotary_embedding: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                        arguments: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's (cos, sin) with each position p at its own length, p + 1, as its decode step rotated it: where
    the factors switch inside the sequence, each side in a call of its own (the positions read on the host: replay
    steps run eagerly, never in a graph)."""
    switch = rope_switch_tokens(rotary_embedding.config)
    short = position_ids.shape[1] if switch is None else int((position_ids[0] < switch).sum())
    if short in (0, position_ids.shape[1]):
        return rotary_embedding(hidden_states, position_ids, *arguments)
    parts = [rotary_embedding(hidden_states, position_ids[:, :short], *arguments),
             rotary_embedding(hidden_states, position_ids[:, short:], *arguments)]
    return torch.cat([cos for cos, _ in parts], dim=1), torch.cat([sin for _, sin in parts], dim=1)


def rope_switch_tokens(config: PretrainedConfig) -> int | None:
    """The original context of a model whose RoPE picks its factors by the length (LongRoPE), else None."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") not in LENGTH_PICKED_ROPE_TYPES:
        return None
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return int(original) if original else None


def _rope_type(rotary_embedding: nn.Module, layer_type: str | None) -> object:
    """The RoPE type transformers' rotary embedding runs for `layer_type` (a dict of types where it takes one)."""
    rope_type = getattr(rotary_embedding, "rope_type", None)
    return rope_type.get(layer_type) if isinstance(rope_type, dict) else rope_type


@functools.cache
def _takes_layer_type(forward: Callable) -> bool:
    return LAYER_TYPE_ARGUMENT in inspect.signature(forward).parameters


def build_mask(builder: Callable, *, cache: object, **arguments: object) -> object:
    """A transformers mask builder's mask (``create_causal_mask`` and kin) for a step over `cache`."""
    return builder(**arguments, **{cache_argument(builder): cache})
