"""GGUFs of every architecture hearth serves, and their configs as the file states them: head sizes, Llama 3's RoPE
scaling (rope_freqs), Gemma 2's soft caps, Gemma 3's local and global layers (Ollama's files too); what hearth cannot
express is refused in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError, SamplingParams, load_full, load_head, load_layer_range
from hearth.inference.gguf_checkpoint import gguf_config_dict
from hearth.inference.gguf_config import completed_gguf_config, llama3_rope_parameters
from hearth.inference.gguf_header import read_gguf_header
from hearth.inference.gguf_parts import split_gguf, write_gguf_part
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import (  # noqa: F401  (own_cache, tiny_gguf: fixtures)
    GEMMA3_GLOBAL_ROPE, LLAMA3_ROPE_OVERRIDES, PHI3_LONGROPE_OVERRIDES, YARN_BETAS_OVERRIDES, YARN_OVERRIDES,
    llama3_rope_freqs, own_cache, tiny_gguf)
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)

PROMPT = "hello there, the quick brown fox"
NEW_ARCHITECTURES = ["qwen3", "phi3", "gemma2", "gemma3"]
# Layers 3-5: a range over local layers and Gemma 3's global one (its sixth).
LAYER_RANGE = (3, 5)


def prefill(runner, head):
    hidden = runner.forward("s", head.embed(head.encode_prompt(PROMPT)), 0, "prefill")
    runner.reset("s")
    return hidden


def assert_layers_match(path, reference, lo=LAYER_RANGE[0], hi=LAYER_RANGE[1]):
    head = load_head(reference)
    from_gguf = load_layer_range(path, lo, hi, **RUNNER_KV_LIMITS)
    expected = load_layer_range(reference, lo, hi, **RUNNER_KV_LIMITS)
    for (name, tensor), (_, want) in zip(from_gguf.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.equal(tensor, want), name
    assert torch.equal(prefill(from_gguf, head), prefill(expected, head))


@pytest.mark.parametrize("architecture", NEW_ARCHITECTURES)
@pytest.mark.parametrize("block_type", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_a_layer_range_of_each_architectures_gguf_computes_what_its_weights_do(tiny_gguf, architecture, block_type):
    path, reference = tiny_gguf(architecture, block_type)
    assert_layers_match(path, reference)


@pytest.mark.parametrize("architecture", NEW_ARCHITECTURES)
def test_a_whole_gguf_of_each_architecture_generates_its_weights_greedy_tokens(tiny_gguf, architecture):
    path, reference = tiny_gguf(architecture, GGMLQuantizationType.Q8_0)
    params = SamplingParams(max_tokens=8, stop_token_ids=())
    expected = load_full(reference, **RUNNER_KV_LIMITS)
    model = load_full(path, **RUNNER_KV_LIMITS)
    prompt = expected.head.encode_prompt(PROMPT)
    assert list(model.generate_ids(prompt, params)) == list(expected.generate_ids(prompt, params))


def test_the_config_states_what_transformers_gguf_reader_leaves_out(tiny_gguf):
    qwen3 = gguf_config_dict(tiny_gguf("qwen3", GGMLQuantizationType.F32)[0])
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    gemma2 = gguf_config_dict(tiny_gguf("gemma2", GGMLQuantizationType.F32)[0])
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (5.0, 3.0)
    assert gemma2["query_pre_attn_scalar"] == 16


def test_gemma3s_layers_and_their_rope_are_read_as_llama_cpp_reads_them(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("gemma3", GGMLQuantizationType.F32)
    config = gguf_config_dict(path)
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == 8 and config["query_pre_attn_scalar"] == 16
    assert config["rope_parameters"] == {"full_attention": GEMMA3_GLOBAL_ROPE,
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

    # A file without a window (a converted config of one layer pattern): every layer global, on the file's base.
    unscaled = _with_keys(path, tmp_path / "global.gguf", "gemma3", {}, dropped=(
        "gemma3.attention.sliding_window", "gemma3.rope.scaling.type", "gemma3.rope.scaling.factor"))
    config = gguf_config_dict(unscaled)
    assert config["layer_types"] == ["full_attention"] * 6 and config["sliding_window"] is None
    assert config["rope_parameters"]["full_attention"] == {"rope_type": "default", "rope_theta": 100000.0}


def test_gemma_27bs_query_scale_follows_llama_cpps_rule():
    gemma3_27b = {"hidden_size": 5376, "num_attention_heads": 32, "head_dim": 128, "num_hidden_layers": 62,
                  "rope_parameters": {}}
    completed = completed_gguf_config(gemma3_27b, "gemma3", {"gemma3.attention.sliding_window": 1024}, set(),
                                      lambda name: np.zeros(0), "g.gguf")
    assert completed["query_pre_attn_scalar"] == 168
    gemma3_12b = {**gemma3_27b, "hidden_size": 3840, "num_attention_heads": 16, "head_dim": 256,
                  "num_hidden_layers": 48}
    completed = completed_gguf_config(gemma3_12b, "gemma3", {}, set(), lambda name: np.zeros(0), "g.gguf")
    assert completed["query_pre_attn_scalar"] == 256


def test_llama3_rope_scaling_is_read_from_rope_freqs(tiny_gguf):
    path, reference = tiny_gguf("llama", GGMLQuantizationType.Q8_0, **LLAMA3_ROPE_OVERRIDES)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}

    assert gguf_config_dict(path)["rope_parameters"] == LLAMA3_ROPE_OVERRIDES["rope_parameters"]
    assert_layers_match(path, reference)


@pytest.mark.parametrize("factor, original", [(8.0, 8192), (32.0, 8192), (8.0, 2000), (4.0, 1024)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_parameters_come_back_from_the_converters_divisors(factor, original, head_dim):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    recovered = llama3_rope_parameters(llama3_rope_freqs(rope, head_dim), 500000.0, head_dim, "x.gguf")
    assert recovered == rope


def test_divisors_of_another_scaling_are_refused_not_guessed():
    rope = {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
            "original_max_position_embeddings": 8192}
    with pytest.raises(CheckpointError, match="no Llama 3 RoPE scaling"):
        llama3_rope_parameters(llama3_rope_freqs(rope, 128), 500000.0, 128, "x.gguf")
    with pytest.raises(CheckpointError, match="one positive divisor"):
        llama3_rope_parameters(np.ones(3, dtype=np.float32), 500000.0, 128, "x.gguf")
    assert llama3_rope_parameters(np.ones(64, dtype=np.float32), 500000.0, 128, "x.gguf") is None


def _with_keys(source, path, architecture, keys, extra_tensors=(), dropped=()):
    """A copy of `source` with more metadata `keys` ({key: (value, GGUFValueType[, item type of an array])}) and
    `extra_tensors`, without the keys `dropped`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in dropped:
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[1] if len(field.types) > 1 else None)
    for key, (value, value_type, *sub_type) in keys.items():
        writer.add_key_value(key, value, value_type, sub_type=sub_type[0] if sub_type else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    for name, values in extra_tensors:
        writer.add_tensor(name, values, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


STRING, FLOAT, UINT = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("architecture, keys, extra, named", [
    ("llama", {"llama.rope.scaling.type": ("yarn", STRING), "llama.rope.scaling.factor": (4.0, FLOAT),
               "llama.rope.scaling.yarn_attn_factor": (0.5, FLOAT)}, (), "yarn_attn_factor of 0.5"),
    ("qwen3", {"qwen3.rope.scaling.type": ("yarn", STRING), "qwen3.rope.scaling.factor": (4.0, FLOAT),
               "qwen3.rope.scaling.attn_factor": (0.8, FLOAT)}, (), "scaling.attn_factor of 0.8"),
    ("qwen2", {"qwen2.rope.scaling.type": ("yarn", STRING), "qwen2.rope.scaling.factor": (0.5, FLOAT)}, (),
     "factor of at least 1"),
    ("llama", {"llama.rope.scaling.type": ("dynamic", STRING)}, (), "'dynamic'"),
    ("llama", {}, (("rope_factors_long.weight", np.ones(8, dtype=np.float32)),), "LongRoPE"),
    ("phi3", {}, (("rope_factors_long.weight", np.ones(8, dtype=np.float32)),), "without its pair"),
    ("phi3", {"phi3.rope.scaling.type": ("yarn", STRING)}, (), "'yarn'"),
    ("phi3", {"phi3.rope.scaling.type": ("longrope", STRING)}, (), "'longrope'"),
    ("qwen3", {"qwen3.rope.dimension_count": (16, UINT)}, (), "rotates 16 of each head's 32 dimensions"),
    ("qwen2", {}, (("rope_freqs.weight", np.ones(8, dtype=np.float32)),), "Llama 3's RoPE scaling only"),
    ("gemma3", {"gemma3.rope.scaling.type": ("yarn", STRING), "gemma3.rope.scaling.factor": (4.0, FLOAT),
                "gemma3.rope.scaling.yarn_log_multiplier": (0.1, FLOAT)}, (), "log_multiplier"),
    ("llama", {"llama.expert_count": (4, UINT)}, (), "mixture-of-experts llama model (4 experts a layer"),
    ("qwen2", {}, (("blk.0.ffn_gate_exps.weight", np.ones(8, dtype=np.float32)),), "such as blk.0.ffn_gate_exps"),
    ("llama", {"llama.attention.key_length": ("abc", STRING)}, (), "llama.attention.key_length as 'abc', not a"),
    ("llama", {"llama.rope.scaling.type": ("yarn", STRING), "llama.rope.scaling.factor": (4.0, FLOAT),
               "llama.rope.scaling.yarn_ext_factor": ("x", STRING)}, (), "yarn_ext_factor as 'x'"),
    ("qwen2", {"qwen2.rope.scaling.type": ("linear", STRING),
               "qwen2.rope.scaling.factor": (float("nan"), FLOAT)}, (), "rope.scaling.factor as nan"),
])
def test_positions_hearth_cannot_express_are_refused_in_one_line(tiny_gguf, tmp_path, architecture, keys, extra,
                                                                  named):
    source, _ = tiny_gguf(architecture, GGMLQuantizationType.F32)
    path = _with_keys(source, tmp_path / "odd.gguf", architecture, keys, extra)
    with pytest.raises(CheckpointError) as refused:
        load_layer_range(path, 0, 0, **RUNNER_KV_LIMITS)
    message = str(refused.value)
    assert "\n" not in message and "odd.gguf" in message and named in message


def test_phi3s_longrope_and_partial_rotary_are_read_from_its_factor_tensors(tiny_gguf):
    path, reference = tiny_gguf("phi3", GGMLQuantizationType.Q8_0, **PHI3_LONGROPE_OVERRIDES)
    config = gguf_config_dict(path)
    assert config["original_max_position_embeddings"] == 16
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["partial_rotary_factor"]) == ("longrope", 0.5) and "attention_factor" not in rope
    assert rope["long_factor"] == pytest.approx(PHI3_LONGROPE_OVERRIDES["rope_parameters"]["long_factor"])

    assert_layers_match(path, reference)  # a prompt past the original context: the long factors
    params = SamplingParams(max_tokens=8, stop_token_ids=())
    expected, model = load_full(reference, **RUNNER_KV_LIMITS), load_full(path, **RUNNER_KV_LIMITS)
    prompt = expected.head.encode_prompt("hello there, the quick")
    assert len(prompt) < 16 < len(prompt) + 8  # prefilled on the short factors, decoded into the long ones
    assert list(model.generate_ids(prompt, params)) == list(expected.generate_ids(prompt, params))


def test_a_header_alone_states_longrope_without_its_tensors_and_still_sizes_a_range(tiny_gguf, tmp_path):
    source, _ = tiny_gguf("phi3", GGMLQuantizationType.Q8_0, **PHI3_LONGROPE_OVERRIDES)
    stated = _with_keys(source, tmp_path / "stated.gguf", "phi3", {"phi3.rope.scaling.type": ("longrope", STRING)})
    split = split_gguf(stated)
    header_alone = write_gguf_part(tmp_path / "header.gguf", stated.read_bytes()[:split.header_bytes], split.kv_end,
                                   split.alignment, [])

    assert gguf_config_dict(header_alone)["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert gguf_config_dict(stated)["rope_parameters"]["rope_type"] == "longrope"


@pytest.mark.parametrize("architecture, overrides", [("qwen3", YARN_OVERRIDES), ("qwen2", YARN_BETAS_OVERRIDES),
                                                     ("llama", YARN_OVERRIDES)])
def test_yarn_scaling_is_read_as_llama_cpp_applies_it(tiny_gguf, architecture, overrides):
    path, reference = tiny_gguf(architecture, GGMLQuantizationType.Q8_0, **overrides)
    rope = gguf_config_dict(path)["rope_parameters"]
    assert rope == overrides["rope_parameters"]
    assert_layers_match(path, reference)
    params = SamplingParams(max_tokens=8, stop_token_ids=())
    expected, model = load_full(reference, **RUNNER_KV_LIMITS), load_full(path, **RUNNER_KV_LIMITS)
    prompt = expected.head.encode_prompt(PROMPT)
    assert list(model.generate_ids(prompt, params)) == list(expected.generate_ids(prompt, params))


def test_linear_rope_scaling_is_read(tiny_gguf, tmp_path):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32)
    path = _with_keys(source, tmp_path / "linear.gguf", "llama", {
        "llama.rope.scaling.type": ("linear", STRING), "llama.rope.scaling.factor": (2.0, FLOAT)})
    assert gguf_config_dict(path)["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}


# Gemma 3 as Ollama's converter wrote it: the global and local bases under keys of its own, no RoPE scaling though the
# context is the 4B's, no norm epsilon, a per-layer pattern, and the vision tower and projector in the same file.
OLLAMA_GEMMA3_OVERRIDES = dict(
    max_position_embeddings=131072, rms_norm_eps=1e-6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})


OLLAMA_END_OF_TURN = 7


def ollama_gemma3(source, path):
    return _with_keys(source, path, "gemma3", {
        "gemma3.rope.global.freq_base": (1_000_000.0, FLOAT), "gemma3.rope.local.freq_base": (20000.0, FLOAT),
        "gemma3.attention.sliding_window_pattern": ([True, True, False] * 2, gguf.GGUFValueType.ARRAY,
                                                    gguf.GGUFValueType.BOOL),
        "tokenizer.ggml.eos_token_ids": ([2, OLLAMA_END_OF_TURN], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
        "gemma3.final_logit_softcapping": (30.0, FLOAT),  # Ollama's converter's default, no Gemma 3's
    }, extra_tensors=(("v.blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float32)),
                      ("mm.input_projection.weight", np.ones((8, 64), dtype=np.float32))),
        dropped=("gemma3.rope.freq_base", "gemma3.rope.scaling.type", "gemma3.rope.scaling.factor",
                 "gemma3.attention.layer_norm_rms_epsilon", "gemma3.vocab_size"))


def test_an_ollama_gemma3_gguf_is_read_as_llama_cpp_reads_it(tiny_gguf, tmp_path):
    source, reference = tiny_gguf("gemma3", GGMLQuantizationType.Q8_0, **OLLAMA_GEMMA3_OVERRIDES)
    path = ollama_gemma3(source, tmp_path / "ollama.gguf")
    config = gguf_config_dict(path)
    assert config["rope_parameters"] == OLLAMA_GEMMA3_OVERRIDES["rope_parameters"]
    assert config["layer_types"] == OLLAMA_GEMMA3_OVERRIDES["layer_types"] and config["vocab_size"] == 320
    assert config.get("final_logit_softcapping") is None
    assert {2, OLLAMA_END_OF_TURN} <= load_head(path).eos_token_ids  # Ollama's list of end-of-generation tokens
    assert_layers_match(path, reference)  # local layers 3 and 4, global layer 5

    params = SamplingParams(max_tokens=8, stop_token_ids=())
    expected, model = load_full(reference, **RUNNER_KV_LIMITS), load_full(path, **RUNNER_KV_LIMITS)
    prompt = expected.head.encode_prompt(PROMPT)
    assert list(model.generate_ids(prompt, params)) == list(expected.generate_ids(prompt, params))

    # The vision tower is no part of any split, so no shard, store object or hub range carries it.
    for split in (split_gguf(path), read_gguf_header(path).split):
        names = {tensor.name for tensor in split.tensors}
        assert "token_embd.weight" in names and not any(name.startswith(("v.", "mm.")) for name in names)
