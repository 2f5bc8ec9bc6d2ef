"""Loading a layer range costs the host no more than the range's weights + 10 % (issue 14), measured in a fresh process;
reading tensors a chunk at a time gives exactly the tensors a whole-tensor read and conversion gives.

The checkpoint is fp32 and the range loads in bf16, so every tensor is converted: the path where a loader that read
whole tensors (or whole layers) before converting them would hold the fp32 originals next to their bf16 copies.
The measuring process is scripts/bench_load_memory.py's (it resets VmHWM through /proc/self/clear_refs after its
imports, then reports the peak resident memory the load added).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hearth.inference.checkpoint import STAGING_CHUNK_BYTES, SafetensorsCheckpoint

from .inference_tiny_models import write_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_SCRIPT = REPO_ROOT / "scripts" / "bench_load_memory.py"
MiB = 1024 * 1024
# Layers of 7.1 M parameters (28 MiB in fp32): allocator noise is small next to them, and a loader that holds one
# fp32 layer besides the bf16 range (1 + 2/3 of the weights for three layers) misses the bound by far.
BIG_LAYERS = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                  num_hidden_layers=4)
LOADED_LAYERS = "1-3"
# An untied lm_head of 24.6 M parameters (94 MiB in fp32, 23 MiB in int8) beside one small layer.
BIG_VOCABULARY = dict(vocab_size=32000, hidden_size=768, intermediate_size=256, num_attention_heads=12,
                      num_key_value_heads=12, head_dim=64, num_hidden_layers=1, tie_word_embeddings=False)
LAYER_PARAMETERS = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768  # q, k, v, o; gate, up, down; two norms
BF16_BYTES = 2
# Besides the weights the loader holds one staging chunk, and a fixed few MiB that do not grow with the weights
# (measured about 1 MiB here: the meta-device skeleton's Python objects, the rotary embedding, pages of the file the
# kernel maps around each read); 4 MiB covers that with room for allocator rounding.
FIXED_ALLOWANCE_BYTES = STAGING_CHUNK_BYTES + 4 * MiB
CHILD_TIMEOUT_S = 120


def peak_rss_reset_allowed() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measured_load(path: Path, what: str, dtype: str, quantization: str = "none") -> dict:
    """scripts/bench_load_memory.py's figures for loading `what` ("head" or "lo-hi") of `path` in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(BENCH_SCRIPT), "--child", what, "--path", str(path),
               "--dtype", dtype, "--device", "cpu", "--quantize", quantization]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not peak_rss_reset_allowed(), reason="needs Linux's /proc/self/clear_refs to reset VmHWM")
def test_loading_a_converted_range_adds_at_most_its_weights_plus_ten_percent(tmp_path):
    path = write_tiny_model(tmp_path / "big-layers", "llama", with_tokenizer=False, **BIG_LAYERS)
    figures = measured_load(path, LOADED_LAYERS, "bfloat16")

    assert figures["peak_method"] == "VmHWM reset before the load"
    weights = figures["weight_bytes"]
    assert weights == 3 * LAYER_PARAMETERS * BF16_BYTES  # the range, and nothing else, was loaded
    bound = 1.10 * weights + FIXED_ALLOWANCE_BYTES
    assert figures["peak_added_bytes"] <= bound, (
        f"loading layers {LOADED_LAYERS} in bf16 added a peak of {figures['peak_added_bytes'] / MiB:.1f} MiB of "
        f"resident memory for {weights / MiB:.1f} MiB of weights (bound {bound / MiB:.1f} MiB)")


@pytest.mark.skipif(not peak_rss_reset_allowed(), reason="needs Linux's /proc/self/clear_refs to reset VmHWM")
def test_an_int8_head_loads_without_its_float_matrix(tmp_path):
    """An untied float lm_head quantized to int8 is read a chunk of rows at a time: the load's peak is its codes in
    the forms fbgemm's packing passes them through (the codes, a quantized tensor of them, the packed copy and its
    offsets), less than the float32 matrix alone (four times the codes), which a whole read holds beside them."""
    path = write_tiny_model(tmp_path / "big-vocabulary", "llama", with_tokenizer=False, **BIG_VOCABULARY)
    figures = measured_load(path, "head", "float32", "int8")
    codes_bytes = BIG_VOCABULARY["vocab_size"] * BIG_VOCABULARY["hidden_size"]
    bound = 4 * codes_bytes + FIXED_ALLOWANCE_BYTES
    assert figures["peak_added_bytes"] <= bound, (
        f"loading the int8 head added a peak of {figures['peak_added_bytes'] / MiB:.1f} MiB "
        f"(bound {bound / MiB:.1f} MiB; its float32 matrix alone is {4 * codes_bytes / MiB:.1f} MiB)")


def test_chunked_reads_equal_whole_tensor_conversion_bit_for_bit(tmp_path):
    generator = torch.Generator().manual_seed(0)
    stored = {
        "matrix": torch.randn(37, 11, generator=generator),  # 19 chunks of 2 rows at 100 bytes, the last one short
        "wide_rows": torch.randn(3, 40, generator=generator),  # a row is larger than a chunk: one row at a time
        "vector": torch.randn(101, generator=generator),
        "scalar": torch.tensor(3.25),
        "stored_bf16": torch.randn(9, 7, generator=generator).to(torch.bfloat16),
        "positions": torch.arange(15, dtype=torch.int64).reshape(5, 3),
    }
    save_file(stored, tmp_path / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path, staging_chunk_bytes=100)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensors = checkpoint.read(stored, dtype)
        with safe_open(tmp_path / "model.safetensors", framework="pt") as whole:
            for name, tensor in tensors.items():
                expected = whole.get_tensor(name)
                expected = expected.to(dtype) if expected.is_floating_point() else expected
                assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (name, dtype)
    stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    assert checkpoint.bytes_read == 3 * stored_bytes
