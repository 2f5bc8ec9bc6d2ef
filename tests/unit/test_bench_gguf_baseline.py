"""`hearth bench` on a GGUF: its one-process baseline is hearth's own path over the file (transformers' GGUF loader
would dequantize every tensor), answering the worker's jobs with the tokens transformers gives for the same weights;
and a baseline's answer, like the pipeline's, holds no stop token."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from hearth.inference.sampling import SamplingParams
from hearth.services.devtools.bench.monolithic import MonolithicJob, MonolithicModel
from tests.unit.gguf_files import own_cache, tiny_gguf  # noqa: F401 (fixtures)

PROMPT_TOKENS = 8
NEW_TOKENS = 6
LONG_ANSWER_TOKENS = 64
BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "hearth-tiny-llama"


def test_a_gguf_baseline_runs_hearths_one_process_path_with_the_files_weights(tiny_gguf):
    path, reference = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    baseline = MonolithicModel(path, quantize="none")  # the reference's precision (the default: as stored, int8)
    transformers_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()

    assert (baseline.info.baseline, baseline.info.quantization) == ("hearth_local", "none")
    assert baseline.info.dtype == "float32"
    assert baseline.info.parameters == sum(p.numel() for p in transformers_model.parameters())
    prompt = baseline.handle(MonolithicJob(kind="prompt", prompt_tokens=PROMPT_TOKENS))
    assert prompt.prompt and 0 < len(prompt.prompt_ids) <= PROMPT_TOKENS
    generated = baseline.handle(MonolithicJob(kind="generate", prompt=prompt.prompt, new_tokens=NEW_TOKENS))
    assert generated.prompt_ids == prompt.prompt_ids
    assert len(generated.token_ids) == len(generated.token_times_s) == NEW_TOKENS
    assert generated.token_times_s == sorted(generated.token_times_s)
    with torch.inference_mode():
        ids = torch.tensor([prompt.prompt_ids])
        expected = transformers_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    assert generated.token_ids == expected[0, ids.shape[1]:].tolist()


def test_a_gguf_baseline_serves_the_meshs_scheme(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    baseline = MonolithicModel(path, quantize="int8")
    prompt = baseline.handle(MonolithicJob(kind="prompt", prompt_tokens=PROMPT_TOKENS))
    generated = baseline.handle(MonolithicJob(kind="generate", prompt=prompt.prompt, new_tokens=NEW_TOKENS))
    local = baseline.handle(MonolithicJob(kind="generate_local", prompt=prompt.prompt, new_tokens=NEW_TOKENS))
    assert generated.token_ids == local.token_ids and len(local.token_ids) == NEW_TOKENS
    assert baseline._local.runner.quantization == "int8"  # what the mesh's shards advertise for this scheme


def test_a_baseline_that_stops_early_counts_no_stop_token_as_the_pipeline_streams_none():
    # The bundled model ends its answer well within 64 tokens; the pipeline streams no stop token (a done frame ends
    # the answer), so a baseline counting one would never match it.
    baseline = MonolithicModel(BUNDLED_MODEL_DIR, quantize="none")
    prompt = baseline.handle(MonolithicJob(kind="prompt", prompt_tokens=PROMPT_TOKENS))
    stop_ids = baseline._local_model().head.stop_token_ids(SamplingParams())
    runs = [baseline.handle(MonolithicJob(kind=kind, prompt=prompt.prompt, new_tokens=LONG_ANSWER_TOKENS))
            for kind in ("generate", "generate_local")]
    assert runs[0].token_ids == runs[1].token_ids and 0 < len(runs[0].token_ids) < LONG_ANSWER_TOKENS
    assert not stop_ids & set(runs[0].token_ids)
    assert all(len(run.token_times_s) == len(run.token_ids) for run in runs)
