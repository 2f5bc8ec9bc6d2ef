"""A GGUF's token embedding is looked up in the file (hearth/inference/stored_embedding.py) wherever nothing else uses
its matrix: each row exactly the value a whole-tensor read gives, for every stored type, and the head holds no copy of
it (an untied one is not even read whole while loading); an lm_head tied to it at full precision keeps the matrix,
and the lookup refuses ids outside the vocabulary."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from hearth.inference import load_head
from hearth.inference.gguf_tensor_table import gguf_table
from hearth.inference.head_weights import half_head_supported
from hearth.inference.stored_embedding import StoredRowsEmbedding
from tests.unit.gguf_files import own_cache, tiny_gguf  # noqa: F401 (fixtures)

BLOCK_TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.F16]


def token_ids(head, count: int = 40) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, head.info.vocab_size, (count,), generator=generator).tolist()


@pytest.mark.parametrize("block_type", BLOCK_TYPES, ids=lambda block_type: block_type.name)
@pytest.mark.parametrize("label", ["none", "int8"])
def test_an_untied_ggufs_embedding_is_read_row_by_row_as_the_whole_tensor_reads(tiny_gguf, block_type, label):
    path, reference = tiny_gguf("llama", block_type)
    from_file, expected = load_head(path, quantization=label, load_tokenizer=False), load_head(reference)
    assert isinstance(from_file._embed_tokens, StoredRowsEmbedding)
    ids = token_ids(expected)
    assert torch.equal(from_file.embed(ids), expected.embed(ids))
    assert torch.equal(from_file.embed(ids[:1]), expected.embed(ids[:1]))
    embedding_bytes = expected.info.vocab_size * expected.info.hidden_size * 4
    assert from_file.weight_bytes <= expected.weight_bytes - embedding_bytes  # no copy of the matrix held
    stored = {tensor.name: tensor.n_bytes for tensor in gguf_table(path).tensors}
    # Loading read the final norm and the lm_head, never the embedding whole.
    assert from_file.checkpoint_bytes_read == stored["output_norm.weight"] + stored["output.weight"]


def test_a_tied_embedding_stays_with_a_full_precision_head_and_leaves_a_float16_one(tiny_gguf):
    path, reference = tiny_gguf("qwen3", GGMLQuantizationType.Q8_0)
    dense = load_head(path, load_tokenizer=False)
    assert type(dense._embed_tokens) is nn.Embedding and dense._lm_head.weight is dense._embed_tokens.weight
    quantized = load_head(path, quantization="int8", load_tokenizer=False)
    expected_type = StoredRowsEmbedding if half_head_supported("cpu") else nn.Embedding
    assert type(quantized._embed_tokens) is expected_type
    ids = token_ids(dense)
    assert torch.equal(quantized.embed(ids), load_head(reference).embed(ids))


def test_the_lookup_refuses_ids_outside_the_vocabulary():
    embedding = StoredRowsEmbedding(lambda ids: torch.zeros(len(ids), 4).numpy(), 10, 4, torch.float32)
    assert embedding(torch.tensor([[0, 9]])).shape == (1, 2, 4)
    for outside in (-1, 10):
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 10\)"):
            embedding(torch.tensor([[1, outside]]))
