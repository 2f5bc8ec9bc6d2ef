"""Batched decode (hearth/inference/batched.py, LayerRangeRunner.step_batch): sessions stepped together give the greedy
tokens each gives alone, for every tiny architecture; sessions joining and leaving between batched steps leave the
others' tokens unchanged; a row's own error does not stop the others."""

from __future__ import annotations

import pytest

from hearth.inference import SessionStateError, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.batched import BatchRow
from hearth.inference.sampling import SamplingParams

from .inference_tiny_models import ARCHITECTURES, one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

GREEDY = SamplingParams(temperature=0.0)
# Past the tiny sliding window (8) for the longer prompts, so windowed masks and trimmed caches are exercised.
NEW_TOKENS = 12
PROMPTS = ["hi", "the quick brown fox", "hearth runs one model", "a", "grüße aus köln",
           "hello there, the quick brown fox jumps", "emoji 🔥", "café"]


def solo_tokens(runners, head, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of one session through the runners one after another, stepped alone."""
    known = list(prompt_ids)
    hidden = head.embed(known)
    for runner in runners:
        hidden = runner.forward("solo", hidden, 0, "prefill")
    tokens = []
    while len(tokens) < NEW_TOKENS:
        tokens.append(head.sample(head.logits(hidden), GREEDY))
        hidden = head.embed([tokens[-1]])
        for runner in runners:
            hidden = runner.forward("solo", hidden, len(known) + len(tokens) - 1, "decode")
    for runner in runners:
        runner.reset("solo")
    return tokens


class BatchedSessions:
    """Sessions prefilled alone and decoded together, one batched step per runner for all of them."""

    def __init__(self, runners, head) -> None:
        self.runners, self.head = runners, head
        self.tokens: dict[str, list[int]] = {}
        self.positions: dict[str, int] = {}

    def join(self, session_id: str, prompt_ids: list[int]) -> None:
        hidden = self.head.embed(prompt_ids)
        for runner in self.runners:
            hidden = runner.forward(session_id, hidden, 0, "prefill")
        self.tokens[session_id] = [self.head.sample(self.head.logits(hidden), GREEDY)]
        self.positions[session_id] = len(prompt_ids)

    def leave(self, session_id: str) -> list[int]:
        for runner in self.runners:
            runner.reset(session_id)
        self.positions.pop(session_id)
        return self.tokens.pop(session_id)

    def step(self) -> None:
        ids = list(self.positions)
        hidden = {sid: self.head.embed([self.tokens[sid][-1]]) for sid in ids}
        for runner in self.runners:
            outputs = runner.step_batch([BatchRow(sid, hidden[sid], self.positions[sid]) for sid in ids])
            hidden = dict(zip(ids, outputs, strict=True))
        for sid, token in zip(ids, self.next_tokens([hidden[sid] for sid in ids]), strict=True):
            self.tokens[sid].append(token)
            self.positions[sid] += 1

    def next_tokens(self, hidden_states) -> list[int]:
        """Each row's greedy token from the states that left the last runner (one session at a time here)."""
        return [self.head.sample(self.head.logits(states), GREEDY) for states in hidden_states]


def decode_eight_sessions_together(path, sessions: type[BatchedSessions] = BatchedSessions, **runner_options):
    """Eight sessions over two runners (`load_layer_range` options) decoded together, and each one's solo tokens."""
    head = load_head(path, device=runner_options.get("device"), dtype=runner_options.get("dtype"))
    options = {**RUNNER_KV_LIMITS, **runner_options}
    runners = [load_layer_range(path, 0, 2, **options), load_layer_range(path, 3, 5, **options)]
    prompts = {f"s{i}": head.encode_prompt(text) for i, text in enumerate(PROMPTS)}
    expected = {sid: solo_tokens(runners, head, ids) for sid, ids in prompts.items()}
    batch = sessions(runners, head)
    for sid, ids in prompts.items():
        batch.join(sid, ids)
    for _ in range(NEW_TOKENS - 1):
        batch.step()
    return batch, expected


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_eight_batched_sessions_give_their_solo_tokens(tiny_model_dir, architecture):
    batch, expected = decode_eight_sessions_together(tiny_model_dir(architecture))
    assert batch.tokens == expected
    assert batch.runners[0]._batched  # the batched path ran, not the one-by-one fallback


def join_and_leave(path, sessions: type[BatchedSessions], joins: dict[int, str], **runner_options
                   ) -> tuple[dict, dict]:
    """Sessions s0..s4 over one runner (`load_layer_range` options): those not in `joins` (step -> session) start
    together, the others join at their step, and each leaves after NEW_TOKENS tokens; the tokens each finished with,
    and its solo tokens."""
    head = load_head(path)
    runners = [load_layer_range(path, 0, 5, **{**RUNNER_KV_LIMITS, **runner_options})]
    prompts = {f"s{i}": head.encode_prompt(text) for i, text in enumerate(PROMPTS[:5])}
    expected = {sid: solo_tokens(runners, head, ids) for sid, ids in prompts.items()}
    batch = sessions(runners, head)
    for sid in sorted(set(prompts) - set(joins.values())):
        batch.join(sid, prompts[sid])
    finished = {}
    for step in range(1, NEW_TOKENS + 2 * len(joins) + 2):
        if step in joins:
            batch.join(joins[step], prompts[joins[step]])
        for sid in [sid for sid, tokens in batch.tokens.items() if len(tokens) == NEW_TOKENS]:
            finished[sid] = batch.leave(sid)
        if not batch.positions:
            break
        batch.step()
    return finished, expected


def test_sessions_joining_and_leaving_mid_batch_leave_the_others_unchanged(tiny_model_dir):
    finished, expected = join_and_leave(tiny_model_dir("qwen2"), BatchedSessions, {3: "s3", 5: "s4"})  # mixed layers
    assert finished == expected


def test_a_row_s_own_error_does_not_stop_the_others(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)
    runner.forward("a", head.embed([1, 5, 6]), 0, "prefill")
    runner.forward("b", head.embed([1, 7]), 0, "prefill")
    outcomes = runner.step_batch([BatchRow("a", head.embed([9]), 3), BatchRow("ghost", head.embed([9]), 4),
                                    BatchRow("b", head.embed([9]), 5), BatchRow("a", head.embed([9]), 4)])
    assert outcomes[0].shape == (1, 1, head.info.hidden_size)
    assert isinstance(outcomes[1], SessionStateError)
    assert isinstance(outcomes[2], SessionStateError)  # b holds 2 tokens, not 5
    assert isinstance(outcomes[3], ValueError)  # a twice in one batch
    assert runner.cached_tokens("a") == 4 and runner.cached_tokens("b") == 2
