"""LogitShaping: one call's logit bias and penalties applied to its next-token logits, its token chosen from them, and
the log-probabilities it reports of that choice.

Order (vLLM's, which keeps OpenAI's "bias, then presence/frequency"): `logit_bias` is added (transformers'
SequenceBiasLogitsProcessor with one-token sequences), then the repetition penalty divides the logits of every token
in the prompt or generated so far (multiplies the negative ones: transformers' RepetitionPenaltyLogitsProcessor, the
CTRL penalty), then OpenAI's penalties subtract ``count * frequency_penalty + (count > 0) * presence_penalty`` by the
counts of generated tokens (transformers has no processor for these). A call with a grammar (`response_format`,
tools: hearth/inference/grammar.py) then has every token its grammar forbids next set to -inf. Temperature, top-k and
top-p follow as for any call (hearth/inference/sampling.py).

Reported log-probabilities are the log-softmax of the shaped logits (the grammar's mask included), before
temperature, top-k and top-p: they say how likely the model (biased, penalised and constrained as asked) finds each
token whatever the sampling settings, and with no bias, penalty or grammar they are the model's own next-token
log-softmax (what `generate(output_logits=True)` gives). With a grammar they are those of the distribution the token
was drawn from: a token the grammar forbids is reported at -9999.0 (OpenAI's floor) however likely the model found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from .grammar import GrammarState
from .sampling import SamplingParams, sample_token


@dataclass(frozen=True)
class StepLogprobs:
    """The log-probability of the token sampled at one step and the best alternatives there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogitShaping:
    """The per-call state the options need: the call's prompt and generated tokens (read, never copied: the call's
    own lists, which grow as it samples), its grammar's matcher (None: unconstrained) and the log-probabilities of
    its last step (``last``)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], generated: Sequence[int],
                 grammar: GrammarState | None = None) -> None:
        self.params = params
        self.grammar = grammar
        self._prompt_ids = prompt_ids
        self._generated = generated
        self._repetition = (RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
                            if params.repetition_penalty != 1.0 else None)
        # Made at the first step, when the vocabulary's size is known.
        self._bias: SequenceBiasLogitsProcessor | None = None
        self._bias_vocab_size: int | None = None
        self.last: StepLogprobs | None = None

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """The next token for 1-D logits ``[vocab]`` (sampled as ``sample_token`` does from the shaped logits), its
        log-probabilities kept in ``last`` when the call asked for them."""
        scores = self.shape(logits) if self.params.shapes_logits else logits
        if self.grammar is not None:
            scores = self.grammar.mask(scores)
        token_id = sample_token(scores, self.params, generator)
        self.last = self.logprobs_of(scores, token_id) if self.params.logprobs else None
        return token_id

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits ``[vocab]`` with bias and penalties applied (float32, on the CPU)."""
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D [vocab], got shape {list(logits.shape)}")
        scores = logits.detach().to(device="cpu", dtype=torch.float32).unsqueeze(0)
        vocab_size = scores.shape[-1]
        bias = self._bias_for(vocab_size)
        if bias is not None:
            scores = bias(torch.empty((1, 0), dtype=torch.long), scores)
        if self._repetition is not None:
            seen = torch.as_tensor([*self._prompt_ids, *self._generated], dtype=torch.long).unsqueeze(0)
            scores = self._repetition(seen, scores)
        if (self.params.presence_penalty or self.params.frequency_penalty) and self._generated:
            generated = torch.as_tensor(list(self._generated), dtype=torch.long)
            counts = torch.bincount(generated[generated < vocab_size], minlength=vocab_size).to(torch.float32)
            scores = (scores - counts * self.params.frequency_penalty
                      - (counts > 0).to(torch.float32) * self.params.presence_penalty)
        return scores[0]

    def logprobs_of(self, scores: torch.Tensor, token_id: int) -> StepLogprobs:
        """The log-softmax of ``scores`` at ``token_id`` and its ``top_logprobs`` best tokens."""
        logprobs = torch.log_softmax(scores.detach().float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.top_logprobs:
            best = torch.topk(logprobs, min(self.params.top_logprobs, logprobs.numel()))
            top = tuple(zip(best.indices.tolist(), best.values.tolist()))
        return StepLogprobs(token_id, float(logprobs[token_id]), top)

    def _bias_for(self, vocab_size: int) -> SequenceBiasLogitsProcessor | None:
        if self._bias_vocab_size != vocab_size:
            # Ids beyond the vocabulary name no token that could be sampled: there is nothing to bias.
            biases = [[[token_id], bias] for token_id, bias in self.params.logit_bias if token_id < vocab_size]
            self._bias = SequenceBiasLogitsProcessor(biases) if biases else None
            self._bias_vocab_size = vocab_size
        return self._bias
