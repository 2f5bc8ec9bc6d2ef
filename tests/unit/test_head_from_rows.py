"""A float checkpoint's lm_head held in int8 is quantized from the checkpoint's rows a chunk at a time
(hearth/inference/head_weights.served_lm_head_of_rows): the same codes as quantizing the loaded matrix, without ever
reading the matrix whole into the compute dtype."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file
from torch import nn

from hearth.inference import load_head
from hearth.inference.checkpoint import SafetensorsCheckpoint
from hearth.inference.errors import CheckpointError
from hearth.inference.gguf_checkpoint import GGUFCheckpoint
from hearth.inference.head_weights import served_lm_head
from hearth.inference.quantization import QuantizationError, QuantizedLinear, parse_quantization
from hearth.inference.stored_embedding import StoredRowsEmbedding

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import tiny_model_dir  # noqa: F401  (fixture)

INT8 = parse_quantization("int8")


def uneven_chunks(weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(weight.detach().split(sizes))


def test_int8_codes_from_rows_in_any_chunks_are_those_of_the_whole_weight():
    torch.manual_seed(4)
    dense = nn.Linear(128, 320, bias=False)
    whole = QuantizedLinear(dense, INT8)
    on_meta = nn.Linear(128, 320, bias=False, device="meta")
    from_rows = QuantizedLinear(on_meta, INT8, weight_rows=uneven_chunks(dense.weight, [7, 100, 213]))
    inputs = torch.randn(5, 128)
    assert torch.equal(from_rows(inputs), whole(inputs))


@pytest.mark.parametrize("sizes", [[7, 100], [7, 100, 214]], ids=["too few", "too many"])
def test_rows_that_do_not_come_to_the_weights_are_refused(sizes):
    on_meta = nn.Linear(128, 320, bias=False, device="meta")
    with pytest.raises(QuantizationError, match="rows came to"):
        QuantizedLinear(on_meta, INT8, weight_rows=[torch.zeros(size, 128) for size in sizes])


def test_rows_are_taken_for_int8_only():
    on_meta = nn.Linear(128, 320, bias=False, device="meta")
    with pytest.raises(QuantizationError, match="int8 only"):
        QuantizedLinear(on_meta, parse_quantization("int4/g32"), weight_rows=[torch.zeros(320, 128)])


def test_a_safetensors_matrix_is_read_in_float32_row_chunks_exactly(tmp_path):
    torch.manual_seed(5)
    matrix = torch.randn(10, 6).to(torch.bfloat16)
    save_file({"head.weight": matrix, "ids": torch.arange(4)}, str(tmp_path / "model.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    chunks = list(checkpoint.row_chunks("head.weight", 4))
    assert [chunk.shape for chunk in chunks] == [(4, 6), (4, 6), (2, 6)]
    assert torch.equal(torch.cat([torch.from_numpy(chunk) for chunk in chunks]), matrix.float())
    assert checkpoint.bytes_read == matrix.numel() * 2
    for name, problem in (("ids", "not a matrix of floats"), ("absent", "missing")):
        with pytest.raises(CheckpointError, match=problem):
            list(checkpoint.row_chunks(name, 4))


def whole_reads_of(checkpoint_class, monkeypatch) -> list[str]:
    """The names `checkpoint_class.read` is asked for whole (the head's loads of matrices into the compute dtype)."""
    names_read: list[str] = []
    read = checkpoint_class.read

    def recording_read(self, names, *args, **kwargs):
        names = list(names)
        names_read.extend(names)
        return read(self, names, *args, **kwargs)

    monkeypatch.setattr(checkpoint_class, "read", recording_read)
    return names_read


def test_an_untied_float_heads_int8_codes_come_from_its_rows_never_a_whole_read(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    dense = load_head(path, load_tokenizer=False)
    whole_reads = whole_reads_of(SafetensorsCheckpoint, monkeypatch)
    quantized = load_head(path, quantization="int8", load_tokenizer=False)
    assert "lm_head.weight" not in whole_reads and "model.embed_tokens.weight" in whole_reads
    assert isinstance(quantized._lm_head, QuantizedLinear)
    reference = served_lm_head(dense._lm_head, INT8, torch.device("cpu"), stored_quantized=False)
    torch.manual_seed(6)
    hidden = torch.randn(3, 1, dense.info.hidden_size)
    assert torch.equal(quantized._lm_head(hidden), reference(hidden))
    assert quantized.checkpoint_bytes_read == dense.checkpoint_bytes_read


@pytest.mark.parametrize("architecture", ["llama", "qwen3"], ids=["untied", "tied"])
def test_a_float_ggufs_int8_head_comes_from_its_rows_and_its_embedding_from_the_file(tiny_gguf, architecture,
                                                                                      monkeypatch):
    path, _ = tiny_gguf(architecture, GGMLQuantizationType.F16)
    dense = load_head(path, load_tokenizer=False)
    whole_reads = whole_reads_of(GGUFCheckpoint, monkeypatch)
    quantized = load_head(path, quantization="int8", load_tokenizer=False)
    assert not {"lm_head.weight", "model.embed_tokens.weight"} & set(whole_reads)  # tied or not: neither matrix
    assert isinstance(quantized._lm_head, QuantizedLinear)
    assert isinstance(quantized._embed_tokens, StoredRowsEmbedding)  # no float copy of a tied matrix either
    reference = served_lm_head(dense._lm_head, INT8, torch.device("cpu"), stored_quantized=False)
    torch.manual_seed(7)
    hidden = torch.randn(3, 1, dense.info.hidden_size)
    assert torch.equal(quantized._lm_head(hidden), reference(hidden))
    ids = torch.tensor([[1, 5, 2]])
    assert torch.equal(quantized._embed_tokens(ids), dense._embed_tokens(ids))
