"""Static KV caches (hearth/inference/static_decode.py): on the CPU the eager path over a static cache gives the dynamic
cache's greedy tokens, alone and batched; on a GPU (skipped elsewhere) decode steps replay CUDA graphs and give
generate()'s tokens, and batches of sessions that keep decoding together replay graphs of their own."""

from __future__ import annotations

import gc

import pytest
import torch

from hearth.inference import SessionEvictedError, SessionTooLargeError, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS, SESSION_TTL_S
from hearth.inference.batched import BatchRow
from hearth.inference.static_decode import StaticDecoder, batch_capture_after_sightings, min_graph_width_tokens

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)
from .test_batched_decode import NEW_TOKENS as BATCHED_NEW_TOKENS
from .test_batched_decode import BatchedSessions, decode_eight_sessions_together, join_and_leave
from .test_inference_devices import NEW_TOKENS, PROMPT, generate_reference
from .test_kv_eviction import generate

STATIC_TOKENS = 64
NEW_TOKENS_BATCHED = BATCHED_NEW_TOKENS


def test_a_dynamic_rope_keeps_dynamic_caches_and_graphs_off(tiny_model_dir):
    static = load_layer_range(tiny_model_dir("llama"), 0, 1, static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)
    dynamic_rope = tiny_model_dir("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                            "factor": 2.0})
    runner = load_layer_range(dynamic_rope, 0, 1, static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)
    assert static._static is not None and runner._static is None


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_static_cache_gives_the_dynamic_cache_s_tokens(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    prompt_ids = head.encode_prompt(PROMPT)
    expected, _ = generate(load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS), head, "s", prompt_ids, NEW_TOKENS)
    runner = load_layer_range(path, 0, 5, static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)
    assert runner._static is not None and not runner.graphs_decode  # static, but no graphs on the CPU
    tokens, _ = generate(runner, head, "s", prompt_ids, NEW_TOKENS)
    assert tokens == expected
    assert runner.cached_tokens("s") == len(prompt_ids) + NEW_TOKENS
    assert runner.cache_bytes == STATIC_TOKENS * 6 * 2 * 2 * 16 * 4  # every position of every layer, at once


def test_static_caches_are_evicted_and_re_prefilled_like_dynamic_ones(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    one_session = STATIC_TOKENS * 6 * 2 * 2 * 16 * 4
    runner = load_layer_range(path, 0, 5, static_cache_tokens=STATIC_TOKENS, cache_budget_bytes=one_session,
                              session_ttl_s=SESSION_TTL_S)
    runner.forward("a", head.embed([1, 2, 3]), 0, "prefill")
    runner.forward("b", head.embed([1, 2]), 0, "prefill")
    with pytest.raises(SessionEvictedError):
        runner.forward("a", head.embed([4]), 3, "decode")
    with pytest.raises(SessionTooLargeError):
        runner.forward("long", head.embed(list(range(1, STATIC_TOKENS + 2))), 0, "prefill")


def test_architectures_with_sliding_windows_keep_dynamic_caches(tiny_model_dir):
    runner = load_layer_range(tiny_model_dir("mistral"), 0, 5, static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)
    assert runner._static is None


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_eight_sessions_batched_over_static_caches_give_their_solo_tokens(tiny_model_dir, architecture):
    batch, expected = decode_eight_sessions_together(tiny_model_dir(architecture), static_cache_tokens=STATIC_TOKENS)
    assert batch.tokens == expected
    # The batched path over the static caches ran (eagerly: no graphs on the CPU), not one session at a time.
    assert all(runner._static is not None and runner._static.batched_steps_total == NEW_TOKENS_BATCHED - 1
               for runner in batch.runners)


def test_sessions_joining_and_leaving_a_static_batch_leave_the_others_unchanged(tiny_model_dir):
    finished, expected = join_and_leave(tiny_model_dir("llama"), BatchedSessions, {3: "s3", 5: "s4"},
                                        static_cache_tokens=STATIC_TOKENS)
    assert finished == expected


def test_a_row_past_its_static_cache_fails_alone_in_a_batch(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, 5, static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)
    runner.forward("a", head.embed([1, 5, 6]), 0, "prefill")
    runner.forward("full", head.embed(list(range(1, STATIC_TOKENS + 1))), 0, "prefill")
    outcomes = runner.step_batch([BatchRow("a", head.embed([9]), 3),
                                    BatchRow("full", head.embed([9]), STATIC_TOKENS)])
    assert isinstance(outcomes[0], torch.Tensor) and isinstance(outcomes[1], SessionTooLargeError)
    assert runner.cached_tokens("a") == 4 and runner.cached_tokens("full") == STATIC_TOKENS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")
def test_batches_that_keep_decoding_together_replay_graphs_of_their_own_on_cuda(tiny_model_dir):
    batch, expected = decode_eight_sessions_together(tiny_model_dir("llama"), static_cache_tokens=STATIC_TOKENS,
                                                     device="cuda", dtype="fp32")
    assert batch.tokens == expected
    for runner in batch.runners:
        assert runner.graphs_decode
        # The first sightings of the eight stepped them one by one; from then on their batch replayed one graph.
        assert len(runner._static._batch_graphs) == 1
        assert runner._static.batched_steps_total == NEW_TOKENS_BATCHED - 1 - (batch_capture_after_sightings - 1)
        # Each session's own decode graph (the solo runs' and the eight's first steps) and the batch's one.
        assert runner.graph_captures_total >= len(batch.positions) + 1
    for session_id in list(batch.positions):
        batch.leave(session_id)
    gc.collect()
    assert all(not runner._static._batch_graphs for runner in batch.runners)  # freed with the sessions' caches


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")
@pytest.mark.parametrize(("dtype", "prompt_tokens", "static_tokens"),
                         [("fp32", None, STATIC_TOKENS), ("bf16", None, STATIC_TOKENS),
                          # Decoding from position 120 to 135 crosses a graph width (128 -> 256 positions).
                          ("fp32", min_graph_width_tokens - 8, 4 * min_graph_width_tokens)])
def test_graphed_decode_on_cuda_gives_generate_s_tokens(tiny_model_dir, dtype, prompt_tokens, static_tokens):
    path = tiny_model_dir("llama")
    head = load_head(path, dtype=dtype, device="cuda")
    prompt_ids = head.encode_prompt(PROMPT)
    if prompt_tokens:
        prompt_ids = (prompt_ids * prompt_tokens)[:prompt_tokens]
    runners = [load_layer_range(path, lo, hi, dtype=dtype, device="cuda", static_cache_tokens=static_tokens,
                                **RUNNER_KV_LIMITS) for lo, hi in ((0, 2), (3, 5))]
    assert all(runner.graphs_decode for runner in runners)
    hidden_in, position, kind, tokens = head.embed(prompt_ids), 0, "prefill", []
    for _ in range(NEW_TOKENS):
        hidden = hidden_in
        for runner in runners:
            hidden = runner.forward("s", hidden.cpu(), position, kind).clone()
        tokens.append(head.sample(head.logits(hidden), head_params()))
        position += hidden_in.shape[1]
        hidden_in, kind = head.embed([tokens[-1]]), "decode"
    reference = generate_reference(path, prompt_ids, torch.float32 if dtype == "fp32" else torch.bfloat16, "cuda")
    if dtype == "fp32":
        assert tokens == reference
    else:
        agreeing = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), NEW_TOKENS)
        assert agreeing >= NEW_TOKENS // 2, (tokens, reference)
    widths = {runners[0]._static.graph_width(position + 1 - step) for step in range(1, NEW_TOKENS)}
    assert all(runner.graph_captures_total == len(widths) for runner in runners)  # one graph per width


def head_params():
    from hearth.inference import SamplingParams

    return SamplingParams(temperature=0.0)


class EvictedSessionsRePrefill(BatchedSessions):
    """Batched sessions whose evicted rows (the KV budget holds fewer than all of them) are re-prefilled from
    position 0 with everything known so far, on every runner, as the orchestrator does; the others keep going."""

    def __init__(self, runners, head) -> None:
        super().__init__(runners, head)
        self.prompts: dict[str, list[int]] = {}
        self.re_prefills = 0

    def join(self, session_id: str, prompt_ids: list[int]) -> None:
        self.prompts[session_id] = list(prompt_ids)
        super().join(session_id, prompt_ids)

    def step(self) -> None:
        ids = list(self.positions)
        hidden = {sid: self.head.embed([self.tokens[sid][-1]]) for sid in ids}
        for runner in self.runners:
            outcomes = runner.step_batch([BatchRow(sid, hidden[sid], self.positions[sid]) for sid in ids])
            for sid, outcome in zip(ids, outcomes, strict=True):
                if isinstance(outcome, SessionEvictedError):
                    outcome = self._re_prefill(sid, upto=runner)
                elif isinstance(outcome, Exception):
                    raise outcome
                assert torch.isfinite(outcome).all(), f"{sid}: non-finite activations"
                hidden[sid] = outcome.clone()  # held while the other rows' steps replay graphs
        for sid in ids:
            self.tokens[sid].append(self.head.sample(self.head.logits(hidden[sid]), head_params()))
            self.positions[sid] += 1

    def _re_prefill(self, session_id: str, upto) -> torch.Tensor:
        self.re_prefills += 1
        known = self.prompts[session_id] + self.tokens[session_id]
        hidden = self.head.embed(known)
        for runner in self.runners:
            runner.reset(session_id)
            hidden = runner.forward(session_id, hidden, 0, "prefill")
            if runner is upto:
                return hidden[:, -1:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")
def test_batches_that_change_under_kv_evictions_replay_graphs_with_finite_identical_output(tiny_model_dir):
    # Room for 5 of the 8 sessions' static caches per runner: every batched step evicts some, whose re-prefills
    # change the next batches' rows, so rows keep stepping one by one on their own graphs between batch graphs.
    # Issue 14's first GPU run (Llama-3-8B, 8 sessions, 1 GiB budget) sent NaN to the next hop there.
    one_session = STATIC_TOKENS * 3 * 2 * 2 * 16 * 4
    batch, expected = decode_eight_sessions_together(
        tiny_model_dir("llama"), EvictedSessionsRePrefill, static_cache_tokens=STATIC_TOKENS, device="cuda",
        dtype="fp32", cache_budget_bytes=5 * one_session)
    assert batch.re_prefills > 0
    assert batch.tokens == expected


def test_graphs_attend_the_power_of_two_of_positions_that_covers_their_rows():
    decoder = StaticDecoder(config=None, layers={}, rotary_embedding=None, max_tokens=4096, device=torch.device("cpu"),
                            capture_graphs=False)
    widths = [decoder.graph_width(tokens) for tokens in (1, min_graph_width_tokens, min_graph_width_tokens + 1, 300,
                                                          2048, 2049, 4096)]
    assert widths == [min_graph_width_tokens, min_graph_width_tokens, 2 * min_graph_width_tokens, 512, 2048, 4096,
                      4096]
