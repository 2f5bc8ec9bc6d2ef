"""Quantized shard weights on a GPU (skipped where torch sees none): a quantized Linear on CUDA computes what the
CPU's does with the same codes, graphed quantized decode gives the eager tokens, and batched sessions their solo
tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearth.inference import load_head, load_layer_range, parse_quantization
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.quantization import QuantizedLinear, check_device_supports, head_quantization

from .inference_tiny_models import (  # noqa: F401  (fixtures are used by name)
    one_torch_thread,
    tiny_model_dir,
    write_tiny_model,
)
from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .test_batched_decode import decode_eight_sessions_together
from .test_gguf_stored_int4 import held_linears
from .test_held_forms import MORE_BITS_LAYER, mixed_gguf  # noqa: F401  (a fixture)
from .test_quantization import PROMPT, RELATIVE_ERROR_BOUND, SCHEMES, TYPICAL_INIT_STD

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")]

STATIC_TOKENS = 64
NEW_TOKENS = 12
# The CPU and CUDA int4 kernels multiply the same codes in bfloat16, summing in different orders; CUDA's int8 product
# quantizes each activation row to int8 too, where the CPU's keeps bfloat16 activations.
CPU_CUDA_DIFFERENCE_BOUND = {"int8": 0.03}
DEFAULT_CPU_CUDA_DIFFERENCE_BOUND = 0.01


@pytest.mark.parametrize("label", [*SCHEMES, "int4/g128"])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_quantized_linear_on_cuda_computes_what_the_cpu_s_does(label, rows):
    scheme = parse_quantization(label)
    check_device_supports(scheme, "cuda")
    torch.manual_seed(0)
    dense = nn.Linear(256, 192)
    inputs = torch.randn(2, rows, 256)
    on_cpu = QuantizedLinear(dense, scheme)
    on_cuda = QuantizedLinear(nn.Linear(256, 192).to("cuda"), scheme)
    on_cuda_from_same = QuantizedLinear(dense.to("cuda"), scheme)
    dense = dense.cpu()
    with torch.inference_mode():
        reference, cpu_out = dense(inputs), on_cpu(inputs)
        cuda_out = on_cuda_from_same(inputs.to("cuda")).cpu()
        assert torch.isfinite(on_cuda(inputs.to("cuda"))).all()
    assert cuda_out.dtype == torch.float32 and cuda_out.shape == reference.shape
    difference_bound = CPU_CUDA_DIFFERENCE_BOUND.get(label, DEFAULT_CPU_CUDA_DIFFERENCE_BOUND)
    assert float((cuda_out - cpu_out).norm() / cpu_out.norm()) < difference_bound
    bound = RELATIVE_ERROR_BOUND.get(label, RELATIVE_ERROR_BOUND["int4/g64"]) + difference_bound
    assert float((cuda_out - reference).norm() / reference.norm()) < bound


@pytest.mark.parametrize("label", ["int8", "int4/g32"])
def test_graphed_quantized_decode_on_cuda_gives_the_eager_tokens(tmp_path, label):
    path = write_tiny_model(tmp_path / "llama", "llama", initializer_range=TYPICAL_INIT_STD)
    head = load_head(path, dtype="bf16", device="cuda", quantization=label)
    assert (head_quantization("cuda") is None) == (type(head._lm_head) is nn.Linear)
    prompt_ids = head.encode_prompt(PROMPT)
    token_lists = []
    for static_tokens in (None, STATIC_TOKENS):
        runners = [load_layer_range(path, 0, 2, dtype="bf16", device="cuda", quantization=label,
                                    static_cache_tokens=static_tokens, **RUNNER_KV_LIMITS),
                   load_layer_range(path, 3, 5, dtype="bf16", device="cuda", quantization=label,
                                    static_cache_tokens=static_tokens, **RUNNER_KV_LIMITS)]
        assert all(runner.quantization == label for runner in runners)
        assert bool(static_tokens) == all(runner.graphs_decode for runner in runners)
        hidden_in, position, kind, tokens = head.embed(prompt_ids), 0, "prefill", []
        for _ in range(NEW_TOKENS):
            hidden = hidden_in
            for runner in runners:
                hidden = runner.forward("s", hidden.cpu(), position, kind).clone()
            assert torch.isfinite(hidden).all()
            tokens.append(int(head.logits(hidden).argmax()))
            position += hidden_in.shape[1]
            hidden_in, kind = head.embed([tokens[-1]]), "decode"
        token_lists.append(tokens)
    eager, graphed = token_lists
    agreeing = next((i for i, (a, b) in enumerate(zip(eager, graphed)) if a != b), NEW_TOKENS)
    assert agreeing >= NEW_TOKENS // 2, (eager, graphed)


def test_cuda_int8_rows_do_not_depend_on_their_batch():
    torch.manual_seed(4)
    quantized = QuantizedLinear(nn.Linear(256, 192).to("cuda"), parse_quantization("int8"))
    assert quantized._int8_dynamic
    rows = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        together = quantized(rows)
        for first, last in ((0, 1), (3, 11), (11, 40)):
            assert torch.equal(quantized(rows[first:last]), together[first:last])


@pytest.mark.parametrize("label", ["int8", "int4/g32"])
def test_batched_quantized_sessions_on_cuda_keep_their_solo_tokens(tiny_model_dir, label):
    batch, expected = decode_eight_sessions_together(tiny_model_dir("llama"), static_cache_tokens=STATIC_TOKENS,
                                                     device="cuda", dtype="fp32", quantization=label)
    for session, tokens in expected.items():
        produced = batch.tokens[session]
        agreeing = next((i for i, (a, b) in enumerate(zip(produced, tokens)) if a != b), len(tokens))
        assert agreeing >= len(tokens) // 2, (session, produced, tokens)


def test_int4_holds_a_4_bit_mixs_more_precise_matrices_in_int8_on_cuda_too(mixed_gguf):
    runners = {label: load_layer_range(mixed_gguf, 0, 2, dtype="bf16", device="cuda", quantization=label,
                                       **RUNNER_KV_LIMITS) for label in ("int4/g32", "int8")}
    kept = {name for name, linear in held_linears(runners["int4/g32"]).items() if linear.scheme.kind == "int8"}
    assert kept == {f"model.layers.{MORE_BITS_LAYER}.{name}.weight" for name in ("self_attn.v_proj", "mlp.down_proj")}
    hidden = torch.randn(1, 5, runners["int8"].info.hidden_size, dtype=torch.bfloat16)
    outputs = [runner.forward("s", hidden, 0, "prefill") for runner in runners.values()]
    assert torch.equal(*outputs)  # every matrix held alike under both schemes
