"""One timed generation as its caller saw it, and the decode tokens/s and time to first token that follow from it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationTiming:
    """One generation as its caller saw it: seconds from the call to each token."""

    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    construct_ms: float | None = None
    # What the orchestrator said the call waited in its queue (done frame), and the places it was told.
    queue_wait_ms: float | None = None
    queue_positions: list[int] = field(default_factory=list)
    # The code of the final frame when the call did not complete (None: it did).
    error_code: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_ms(self) -> float:
        return self.token_times_s[0] * 1000.0 if self.token_times_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        if self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / (self.token_times_s[-1] - self.token_times_s[0])

    @property
    def end_s(self) -> float:
        return self.token_times_s[-1]


def tokens_before_divergence(runs: list[list[int]], reference: list[int]) -> int:
    """How many leading tokens every run shares with `reference` (its length when all equal it): in bf16 or fp16 a
    near-tie may take greedy decoding down another branch, and this says how soon."""
    shared = len(reference)
    for tokens in runs:
        agreeing = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), shared))
        shared = min(shared, agreeing)
    return shared
