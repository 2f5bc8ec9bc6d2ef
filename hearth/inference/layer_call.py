"""Calls into transformers' public decoder layers and mask builders, passing the KV cache under the name the
installed release gives it (``past_key_values`` in earlier 5.x releases, ``cache`` in later ones such as 5.24, which
keep the old name as a deprecated alias until 5.40), so every release in pyproject's range runs without warnings."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

NEW_CACHE_ARGUMENT = "cache"
OLD_CACHE_ARGUMENT = "past_key_values"
LAYER_TYPE_ARGUMENT = "layer_type"


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
                                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A step's rotary (cos, sin) for each attention type among `attention_types`: one per type where the model's
    rotary embedding takes the layer's type (Gemma 3 rotates local and global layers on different bases), the same
    one for every type otherwise."""
    if _takes_layer_type(type(rotary_embedding).forward):
        return {kind: rotary_embedding(hidden_states, position_ids, kind) for kind in dict.fromkeys(attention_types)}
    shared = rotary_embedding(hidden_states, position_ids)
    return {kind: shared for kind in attention_types}


@functools.cache
def _takes_layer_type(forward: Callable) -> bool:
    return LAYER_TYPE_ARGUMENT in inspect.signature(forward).parameters


def build_mask(builder: Callable, *, cache: object, **arguments: object) -> object:
    """A transformers mask builder's mask (``create_causal_mask`` and kin) for a step over `cache`."""
    return builder(**arguments, **{cache_argument(builder): cache})
