"""Sampling parameters and next-token choice: greedy, temperature, top-k, top-p, per-request seeds (the options that
shape the logits first, and the log-probabilities reported, are hearth/inference/logit_shaping.py's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# The wire's default (hearth/protocol/chat.py default_max_tokens), which inference may not import;
# tests/unit/test_one_home_per_default.py keeps the two equal.
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy (argmax, as ``generate(do_sample=False)``), whatever top-k/top-p say.
    ``top_k == 0`` and ``top_p == 1.0`` switch those filters off. The same ``seed`` gives the same tokens
    for the same logits; ``None`` draws a fresh seed. ``stop`` strings end the text before the match;
    ``stop_token_ids`` add to the model's own end-of-sequence ids.

    ``logit_bias`` (token id -> bias), ``repetition_penalty`` (1 is off), ``presence_penalty`` and
    ``frequency_penalty`` (0 is off) change the logits before any of the above; ``logprobs`` asks for the sampled
    token's log-probability and its ``top_logprobs`` best alternatives (hearth/inference/logit_shaping.py). With none of
    them (``plain``) a request samples from the head's logits as they are.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # Accept lists from JSON-shaped callers while keeping the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if any(token_id < 0 for token_id, _ in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")

    @property
    def shapes_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Neither shapes the logits nor reports log-probabilities: sampling takes the head's logits as they are."""
        return not (self.shapes_logits or self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        """A CPU generator for one request: seeded from ``seed``, or freshly random when it is None."""
        generator = torch.Generator(device="cpu")
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """Next token id from 1-D logits ``[vocab]``, filtered like transformers: temperature, top-k, top-p."""
    if logits.dim() != 1:
        raise ValueError(f"logits must be 1-D [vocab], got shape {list(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    # The request's generator is a CPU one (reproducible whatever device computed the logits).
    scores = logits.float().cpu() / params.temperature
    if bool(torch.isposinf(scores).any()) or not bool(torch.isfinite(scores).any()):
        # A temperature so small (1e-300) that the division overflows float32 puts all the probability on the
        # best token: the limit of sampling as the temperature goes to 0, which every top-k/top-p filter keeps.
        # (-inf alone is no overflow: a grammar's mask forbids tokens that way.)
        return int(torch.argmax(logits))
    if params.top_k > 0 and params.top_k < scores.numel():
        kth_best = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[-1] = False  # the most likely token always survives
        remove = remove_sorted.scatter(0, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probabilities, num_samples=1, generator=generator))
