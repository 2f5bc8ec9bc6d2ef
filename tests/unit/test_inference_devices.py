"""Device and dtype plumbing: `--device`/`--dtype` resolution, bf16 layer ranges on the CPU equal generate() in
bf16, and (where torch sees a GPU) greedy parity with generate() on the same device and dtype."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hearth.inference import SamplingParams, load_full, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.devices import DeviceUnavailable, resolve_compute_dtype, resolve_device
from hearth.inference.host_staging import to_device, to_host

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures are used by name)

PROMPT = "hello there, the quick brown fox"
NEW_TOKENS = 16
has_cuda = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not has_cuda, reason="torch sees no CUDA device here")


def generate_reference(path, prompt_ids, dtype: torch.dtype, device: str) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # random weights may pick EOS; we want every step
    output = model.generate(torch.tensor([prompt_ids], device=device),
                            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                            do_sample=False, max_new_tokens=NEW_TOKENS)
    return output[0, len(prompt_ids):].tolist()


def greedy_tokens(path, *, dtype: str, device: str, split: bool) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy tokens of our runners (two hops when `split`) on `device` in `dtype`."""
    head = load_head(path, dtype=dtype, device=device)
    prompt_ids = head.encode_prompt(PROMPT)
    n = head.info.num_layers
    hops = ([load_layer_range(path, 0, n // 2 - 1, dtype=dtype, device=device, **RUNNER_KV_LIMITS),
             load_layer_range(path, n // 2, n - 1, dtype=dtype, device=device, **RUNNER_KV_LIMITS)] if split
            else [load_full(path, dtype=dtype, device=device, **RUNNER_KV_LIMITS).runner])
    hidden_in, position, kind, tokens = head.embed(prompt_ids), 0, "prefill", []
    for _ in range(NEW_TOKENS):
        hidden = hidden_in
        for runner in hops:
            # Through the CPU between hops, as the wire carries it.
            hidden = runner.forward("s", hidden.cpu(), position, kind)
            assert hidden.device.type == torch.device(device).type
        tokens.append(head.sample(head.logits(hidden.cpu()), SamplingParams(temperature=0.0)))
        position += hidden_in.shape[1]
        hidden_in, kind = head.embed([tokens[-1]]), "decode"
    return prompt_ids, tokens


def test_auto_device_and_dtype_follow_what_torch_sees():
    device = resolve_device("auto")
    assert device.type == ("cuda" if has_cuda else "cpu")
    assert resolve_compute_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_compute_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_compute_dtype("fp16", torch.device("cpu")) is torch.float16
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:", "tpu"])
def test_malformed_devices_are_refused(spec):
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device(spec)


def test_a_cuda_device_that_is_not_here_is_refused_by_name():
    with pytest.raises(DeviceUnavailable, match="cuda:7"):
        resolve_device("cuda:7" if has_cuda and torch.cuda.device_count() <= 7 else
                       ("cuda:7" if not has_cuda else "cuda:9999"))


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_compute_dtype("int4", torch.device("cpu"))


def test_bf16_layer_ranges_on_cpu_give_generate_s_bf16_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt_ids, tokens = greedy_tokens(path, dtype="bf16", device="cpu", split=True)
    runner = load_layer_range(path, 0, 1, dtype="bf16", device="cpu", **RUNNER_KV_LIMITS)
    assert {p.dtype for _, p in runner.named_parameters()} == {torch.bfloat16}
    assert tokens == generate_reference(path, prompt_ids, torch.bfloat16, "cpu")


@pytest.mark.cuda
@cuda_only
def test_fp32_on_cuda_gives_generate_s_tokens_exactly(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt_ids, tokens = greedy_tokens(path, dtype="fp32", device="cuda", split=True)
    assert tokens == generate_reference(path, prompt_ids, torch.float32, "cuda")


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2"])
def test_bf16_on_cuda_agrees_with_generate_on_most_tokens(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    prompt_ids, tokens = greedy_tokens(path, dtype="bf16", device="cuda", split=True)
    reference = generate_reference(path, prompt_ids, torch.bfloat16, "cuda")
    # Greedy decoding in bf16 may take another branch after a near-tie; the first tokens must agree and most of all.
    agreeing = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
    assert agreeing >= NEW_TOKENS // 2, (tokens, reference)


def test_on_the_cpu_host_staging_passes_tensors_through():
    tensor = torch.ones(1, 3, 4)
    assert to_host(tensor) is tensor
    assert to_device(tensor, torch.device("cpu")) is tensor


@pytest.mark.cuda
@cuda_only
def test_a_cuda_output_reaches_pinned_host_memory_intact():
    tensor = torch.randn(1, 5, 64, device="cuda", dtype=torch.bfloat16)
    host = to_host(tensor)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, tensor.cpu())
    assert torch.equal(to_device(host, tensor.device), tensor)
