"""Layered inference equals the monolithic transformers model bit for bit, for every supported family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hearth.inference import (
    SamplingParams,
    adapter_for,
    load_full,
    load_head,
    load_layer_range,
    supported_architectures,
)
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.layer_call import cache_argument

from .inference_tiny_models import (  # noqa: F401  (fixtures are used by name)
    ARCHITECTURES,
    TINY_NUM_LAYERS,
    one_torch_thread,
    tiny_config,
    tiny_model_dir,
)

PROMPT = "hello there, the quick brown fox"
DECODE_STEPS = 20
# Each plan is a list of hops: (layers the runner loads, sub-range it is told to run or None for all).
PLANS = {
    "one_range": [((0, 5), None)],
    "two_ranges": [((0, 2), None), ((3, 5), None)],
    "three_ranges": [((0, 1), None), ((2, 3), None), ((4, 5), None)],
    "overlapping_shards_run_sub_ranges": [((0, 3), (0, 1)), ((1, 5), (2, 5))],
}
CASES = [(arch, "single_file") for arch in ARCHITECTURES] + [("llama", "sharded"), ("gemma2", "sharded")]
SMALL_SHARD_SIZE = "100KB"


def attn_implementation_for(architecture: str) -> str:
    return "eager" if architecture == "gemma2" else "sdpa"


@pytest.fixture(scope="module")
def reference_generation():
    """``get(path, arch)``: the monolithic model's greedy tokens and per-step logits, once per model."""
    results: dict = {}

    def get(path, architecture):
        if path not in results:
            head = load_head(path)
            prompt_ids = head.encode_prompt(PROMPT)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation=attn_implementation_for(architecture)
            )
            model.generation_config.eos_token_id = None  # random weights may pick EOS; we want all steps
            output = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=DECODE_STEPS + 1,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = output.sequences[0, len(prompt_ids) :].tolist()
            results[path] = (prompt_ids, tokens, [step_logits[0] for step_logits in output.logits])
        return results[path]

    return get


def checkpoint_for(tiny_model_dir, architecture: str, layout: str):
    if layout == "sharded":
        return tiny_model_dir(architecture, max_shard_size=SMALL_SHARD_SIZE)
    return tiny_model_dir(architecture)


def run_pipeline(head, hops, prompt_ids, steps, session_id="session-1"):
    """Greedy prefill + ``steps`` decode steps through the hops; returns (tokens, per-step logits)."""
    hidden_in = head.embed(prompt_ids)
    position, kind = 0, "prefill"
    tokens, all_logits = [], []
    for _ in range(steps + 1):
        hidden = hidden_in
        for runner, sub_range in hops:
            hidden = runner.forward(session_id, hidden, position, kind, layers=sub_range)
        logits = head.logits(hidden)
        token = head.sample(logits, SamplingParams(temperature=0.0))
        tokens.append(token)
        all_logits.append(logits)
        position += hidden_in.shape[1]
        hidden_in, kind = head.embed([token]), "decode"
    return tokens, all_logits


def test_every_supported_architecture_has_a_parity_case():
    tested = {adapter_for(tiny_config(architecture)).architecture for architecture in ARCHITECTURES}
    assert tested == set(supported_architectures())


@pytest.mark.parametrize("architecture,layout", CASES, ids=[f"{a}-{layout}" for a, layout in CASES])
def test_layer_ranges_are_bitwise_equal_to_the_monolithic_model(
    tiny_model_dir, reference_generation, architecture, layout
):
    path = checkpoint_for(tiny_model_dir, architecture, layout)
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 2
    prompt_ids, reference_tokens, reference_logits = reference_generation(path, architecture)
    head = load_head(path)
    for plan_name, plan in PLANS.items():
        hops = [
            (load_layer_range(path, lo, hi, attn_implementation=attn_implementation_for(architecture),
                              **RUNNER_KV_LIMITS), sub)
            for (lo, hi), sub in plan
        ]
        tokens, logits = run_pipeline(head, hops, prompt_ids, DECODE_STEPS)
        assert tokens == reference_tokens, plan_name
        assert len(logits) == len(reference_logits) == DECODE_STEPS + 1
        for step, (ours, theirs) in enumerate(zip(logits, reference_logits, strict=True)):
            assert torch.equal(ours, theirs), f"{plan_name}: logits differ at step {step}"


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2"])
def test_chunked_prefill_matches_the_monolithic_model_fed_the_same_chunks(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    attn = attn_implementation_for(architecture)
    head = load_head(path)
    prompt_ids = head.encode_prompt(PROMPT + " jumps over the lazy dog")
    chunks = [prompt_ids[:7], prompt_ids[7:12], prompt_ids[12:]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    cache = DynamicCache(config=model.config)
    hops = [
        load_layer_range(path, 0, 2, attn_implementation=attn, **RUNNER_KV_LIMITS),
        load_layer_range(path, 3, 5, attn_implementation=attn, **RUNNER_KV_LIMITS),
    ]
    position = 0
    for chunk in chunks:
        with torch.inference_mode():
            output = model(torch.tensor([chunk]), use_cache=True, logits_to_keep=1,
                           **{cache_argument(type(model).forward): cache})
            expected = output.logits[0, -1]
        hidden = head.embed(chunk)
        for runner in hops:
            hidden = runner.forward("chunked", hidden, position, "prefill")
        position += len(chunk)
        assert torch.equal(head.logits(hidden), expected)


def test_load_full_generates_the_same_tokens_as_transformers_generate(tiny_model_dir, reference_generation):
    path = tiny_model_dir("qwen3")
    prompt_ids, reference_tokens, _ = reference_generation(path, "qwen3")
    local = load_full(path, **RUNNER_KV_LIMITS)
    assert local.runner.layer_lo == 0 and local.runner.layer_hi == TINY_NUM_LAYERS - 1
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, stop_token_ids=())
    tokens = list(local.generate_ids(prompt_ids, params))
    expected = reference_tokens
    for index, token in enumerate(reference_tokens):  # local generation stops at (and yields) EOS
        if token in local.head.stop_token_ids(params):
            expected = reference_tokens[: index + 1]
            break
    assert tokens == expected
    assert local.runner.session_ids() == []  # the generation's cache is released when it ends


def test_load_full_streams_text_and_seeded_sampling_repeats(tiny_model_dir):
    local = load_full(tiny_model_dir("llama"), **RUNNER_KV_LIMITS)
    prompt_ids = local.head.encode_chat([{"role": "user", "content": "hello there"}])
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    tokens = list(local.generate_ids(prompt_ids, params))
    assert tokens == list(local.generate_ids(prompt_ids, params))
    assert tokens != list(
        local.generate_ids(prompt_ids, SamplingParams(temperature=1.0, seed=8, max_tokens=12))
    )
    deltas = list(local.generate_text(prompt_ids, params))
    assert deltas[-1].finished
    visible_ids = [t for t in tokens if t not in local.head.eos_token_ids]
    # A character the last tokens left unfinished (max_tokens cut inside it) is dropped, not sent as U+FFFD.
    assert "".join(d.text for d in deltas) == local.head.decode(visible_ids).rstrip("\ufffd")
