"""A GGUF's token embedding looked up in the file itself: only the rows a prompt or token asks for are read from the
memory-mapped file and dequantized, each exactly as a whole-tensor read gives it, so a head holds no copy of the
embedding matrix beside its lm_head (BENCHMARKS.md, "A GGUF's quantized head in float16")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

# (token ids) -> their rows, float32 [len(ids), embedding_dim]
RowReader = Callable[[np.ndarray], np.ndarray]


class StoredRowsEmbedding(nn.Module):
    """nn.Embedding's lookup over rows read on demand (`read_rows`), in `dtype`; it holds no weight."""

    def __init__(self, read_rows: RowReader, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.read_rows = read_rows
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        flat = token_ids.reshape(-1).cpu().numpy()
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        rows = torch.from_numpy(self.read_rows(flat)).to(self.dtype)
        return rows.reshape(*token_ids.shape, self.embedding_dim)


def embedding_from_stored_rows(checkpoint, weight_name: str, embed_tokens: nn.Module, lm_head: nn.Module,
                               device: torch.device) -> StoredRowsEmbedding | None:
    """A StoredRowsEmbedding to put in place of `embed_tokens` (a plain nn.Embedding of `weight_name`) when the
    checkpoint can read its rows one by one (a GGUF: `row_reader`) and nothing else uses its weight (an lm_head
    tied to it serves from its own copy: head_weights.py), on the CPU; None where it stays as loaded."""
    read_rows = getattr(checkpoint, "row_reader", None)
    if (read_rows is None or device.type != "cpu" or type(embed_tokens) is not nn.Embedding
            or getattr(lm_head, "weight", None) is embed_tokens.weight):
        return None
    weight = embed_tokens.weight
    return StoredRowsEmbedding(read_rows(weight_name), weight.shape[0], weight.shape[1], weight.dtype)
