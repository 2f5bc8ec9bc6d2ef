"""Attention per row for batched steps on a CPU: transformers' SDPA attention run over each session's own KV cache,
registered under its own implementation name through transformers' public attention and mask interfaces.

Why: a batched step (hearth/inference/batched.py) runs its rows' projections as one product, but stacking every
row's keys and values into one left-padded tensor per layer copies each session's whole cache every layer of every
step, which at long contexts costs more than the attention itself (BENCHMARKS.md, "Batched steps at long contexts").
Here each row attends its own cache's keys and values, under the mask its solo step would get, so a row's attention
is its solo step's attention (bitwise, given the same query), and nothing is copied.

How: a layer range on a CPU whose family attends through SDPA is loaded under `ROW_ATTENTION` (`use_row_attention`).
Its mask builder is SDPA's own, and its attention function is SDPA's own unless the layer was called with
``hearth_rows`` (a `RowCaches` that holds each row's keys, values and masks for that layer) or ``hearth_replay`` (a
replay step's queries, each attended as its decode step was: hearth/inference/layer_pass.py): steps of one session,
and anything else that runs the layers, compute exactly what ``sdpa`` computes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROW_ATTENTION = "hearth_sdpa_rows"
# Implementations whose masks are SDPA's boolean ones (hearth/inference/batched.py, static_decode.py).
SDPA_IMPLEMENTATIONS = ("sdpa", ROW_ATTENTION)


class RowsOfOneLayer(Protocol):
    """What a batched step hands each layer's attention (hearth/inference/batched.py's RowCaches)."""

    new_tokens: list[int]

    def row_attention_inputs(self, row: int, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Row's keys and values after this layer's update (``[1, heads, L_i, dim]``), and its solo step's mask."""


def attention_rows(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, *, hearth_rows: RowsOfOneLayer | None = None,
                   hearth_replay: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA attention; with ``hearth_rows``, each row's real queries (``query``'s right end) over that row's own keys
    and values, ``key``/``value``/``attention_mask`` unused; padding queries' outputs are zeros (dropped later).
    With ``hearth_replay`` (one session's step over a full-attention layer), each query over the keys up to its own, as
    its decode step attended them: the call that step made, with no mask."""
    if hearth_replay and hearth_rows is None and query.shape[2] > 1:
        tokens, keys = query.shape[2], key.shape[2]
        outputs = [sdpa_attention_forward(module, query[:, :, index:index + 1], key[:, :, :keys - tokens + index + 1],
                                          value[:, :, :keys - tokens + index + 1], None, **kwargs)[0]
                   for index in range(tokens)]
        return torch.cat(outputs, dim=1), None
    if hearth_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    most = query.shape[2]
    outputs = []
    for row, tokens in enumerate(hearth_rows.new_tokens):
        row_keys, row_values, row_mask = hearth_rows.row_attention_inputs(row, module.layer_idx)
        output, _ = sdpa_attention_forward(module, query[row:row + 1, :, most - tokens:], row_keys, row_values,
                                           row_mask, **kwargs)
        if tokens < most:  # [1, T_i, heads, dim] -> [1, T, heads, dim], zeros on the padding's side
            output = torch.cat([output.new_zeros(1, most - tokens, *output.shape[2:]), output], dim=1)
        outputs.append(output)
    return torch.cat(outputs), None


AttentionInterface.register(ROW_ATTENTION, attention_rows)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


def use_row_attention(model: nn.Module, device: torch.device) -> None:
    """Switch a CPU model that attends through SDPA to `ROW_ATTENTION` (others keep theirs: a GPU batches on static
    caches, hearth/inference/static_decode.py, and eager families such as Gemma 2 stack their rows)."""
    if device.type == "cpu" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(ROW_ATTENTION)


def attends_by_row(config: PretrainedConfig) -> bool:
    return getattr(config, "_attn_implementation", None) == ROW_ATTENTION
