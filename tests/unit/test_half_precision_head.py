"""A quantized model's lm_head that the checkpoint stores quantized already (a GGUF's Q8_0) is held in float16 on a
CPU with a fast float16 product (hearth/inference/head_weights.py): logits within float16's rounding of the stored
weights', finite whatever the hidden states' scale, batched rows equal to one-row ones, and a head whose logits could
leave float16's range stays as loaded."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from hearth.inference import load_head
from hearth.inference.head_weights import HalfPrecisionHead, half_head_supported, served_lm_head
from hearth.inference.quantization import QuantizedLinear, parse_quantization
from hearth.inference.stored_embedding import StoredRowsEmbedding
from tests.unit.gguf_files import own_cache, tiny_gguf  # noqa: F401 (fixtures)

# float16 keeps 11 bits: each weight and each scaled row within 2**-11 of its own, the logits about as close.
HALF_RELATIVE_ERROR = 2e-3


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


@pytest.mark.skipif(not half_head_supported("cpu"), reason="this CPU has no fast float16 product for torch")
@pytest.mark.parametrize("label", ["int8", "int4/g32"])
def test_a_stored_quantized_head_is_served_in_float16_within_its_rounding(tiny_gguf, label):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    dense, served = load_head(path, load_tokenizer=False), load_head(path, quantization=label, load_tokenizer=False)
    assert type(dense._lm_head) is nn.Linear
    assert isinstance(served._lm_head, HalfPrecisionHead)
    torch.manual_seed(5)
    states = [torch.randn(1, length, dense.info.hidden_size) for length in (1, 4, 2)]
    logits, bounds = served.batch_logits(states)
    for row, hidden in enumerate(states):
        alone = served.logits(hidden)
        assert alone.dtype == torch.float32
        assert relative_error(alone, dense.logits(hidden)) < HALF_RELATIVE_ERROR
        assert torch.equal(logits[row], alone)  # every row is its own product, batched or not
    assert bool((bounds >= 0).all())


def test_rows_of_any_scale_stay_finite_and_within_float16s_rounding():
    torch.manual_seed(1)
    linear = nn.Linear(64, 300, bias=True)
    half = HalfPrecisionHead.of_linear(linear)
    with torch.inference_mode():
        for scale in (1e-6, 1.0, 1e6):  # 1e6 overflows float16 unless each row is scaled first
            hidden = torch.randn(3, 64) * scale
            ours, reference = half(hidden), linear(hidden)
            assert ours.dtype == torch.float32 and bool(torch.isfinite(ours).all())
            assert relative_error(ours, reference) < HALF_RELATIVE_ERROR


def test_which_module_serves_an_lm_head():
    linear = nn.Linear(32, 100, bias=False)
    int8, none = parse_quantization("int8"), parse_quantization("none")
    assert served_lm_head(linear, none, torch.device("cpu"), stored_quantized=True) is linear
    assert isinstance(served_lm_head(linear, int8, torch.device("cpu"), stored_quantized=False), QuantizedLinear)
    stored = served_lm_head(linear, int8, torch.device("cpu"), stored_quantized=True)
    assert isinstance(stored, HalfPrecisionHead) if half_head_supported("cpu") else stored is linear
    with torch.no_grad():
        linear.weight.fill_(2048.0)  # rows summing past float16's range: logits of a row scaled to 1 could overflow
    assert not HalfPrecisionHead.fits(linear)
    assert served_lm_head(linear, int8, torch.device("cpu"), stored_quantized=True) is linear


def test_one_row_past_float16s_range_anywhere_keeps_the_head_as_loaded():
    linear = nn.Linear(16, 5000, bias=False)
    assert HalfPrecisionHead.fits(linear)
    with torch.no_grad():
        linear.weight[4500].fill_(4096.0)  # a row past the first chunk of rows the check reads at a time
    assert not HalfPrecisionHead.fits(linear)


@pytest.mark.skipif(not half_head_supported("cpu"), reason="this CPU has no fast float16 product for torch")
@pytest.mark.parametrize("architecture", ["llama", "qwen3"], ids=["untied", "tied"])
def test_a_head_built_from_the_files_rows_is_the_one_built_from_the_loaded_matrix(tiny_gguf, architecture):
    """The float16 head is built a chunk of rows at a time from the file (the matrix is never held whole in float32,
    nor the tied embedding beside it), to the same bits as from the loaded float32 lm_head."""
    path, _ = tiny_gguf(architecture, GGMLQuantizationType.Q8_0)
    dense, served = load_head(path, load_tokenizer=False), load_head(path, quantization="int8", load_tokenizer=False)
    assert isinstance(served._lm_head, HalfPrecisionHead)
    assert torch.equal(served._lm_head.weight, HalfPrecisionHead.of_linear(dense._lm_head).weight)
    assert isinstance(served._embed_tokens, StoredRowsEmbedding)  # looked up in the file: no float32 copy either
    assert served.checkpoint_bytes_read == dense.checkpoint_bytes_read  # the rows read count as a read of the matrix


def test_rows_that_do_not_fit_float16_build_no_head():
    rows = [torch.ones(4096, 16).numpy(), torch.full((10, 16), 4096.0).numpy()]
    assert HalfPrecisionHead.of_row_chunks(iter(rows), 4106, 16, torch.float32) is None
    built = HalfPrecisionHead.of_row_chunks(iter(rows[:1]), 4096, 16, torch.float32)
    assert built is not None and built.weight.dtype == torch.float16 and bool((built.weight == 1).all())
