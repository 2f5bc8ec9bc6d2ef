"""Call: everything one `llm.chat.request` is while the orchestrator serves it (the request, its model, its
pipeline id, its status, its sampling state, the tokens so far, its timing, its failovers, what the client was
sent through its ClientStream)."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from hearth.inference import SamplingParams, TextStream
from hearth.inference.grammar import GrammarState
from hearth.inference.logit_shaping import LogitShaping
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import TokenAlternative, TokenLogprobs
from hearth.services.orchestrator.catalog import LoadedModel
from hearth.services.orchestrator.client_stream import ClientStream
from hearth.services.orchestrator.constrained import FINISH_TOOL_CALLS, OutputGrammar, output_grammar
from hearth.services.orchestrator.outcomes import SampledToken

pipeline_id_random_bytes = 16


def new_pipeline_id() -> str:
    """128 random bits: a pipeline's activation subjects carry its id, so it must not be guessable."""
    return "p-" + secrets.token_hex(pipeline_id_random_bytes)


class CallStatus(enum.Enum):
    """Where a call is in its life; `Call.advance` is the one place it changes (NEXT_STATUSES says to what)."""

    admitted = "admitted"  # its turn came (hearth/services/orchestrator/queue.py) and its prompt is tokenized
    routing = "routing"  # opening a chain over what the router plans
    prefilling = "prefilling"  # everything known so far goes through a fresh chain (or again through the same one)
    decoding = "decoding"  # sampling a token from each step's output and stepping it through the chain
    recovering = "recovering"  # a step or routing failed: carrying out the recovery policy's decision
    finished = "finished"  # the done frame went out
    aborted = "aborted"  # the aborted frame went out
    client_gone = "client_gone"  # the client stopped listening; the call was cancelled
    past_deadline = "past_deadline"  # it ran past [orchestrator] request_deadline_s; the call was cancelled

    @property
    def final(self) -> bool:
        return self in (CallStatus.finished, CallStatus.aborted, CallStatus.client_gone, CallStatus.past_deadline)


# What may end a call in any status: a cancellation from outside the call's loop.
CANCELLED_STATUSES = frozenset({CallStatus.client_gone, CallStatus.past_deadline})


NEXT_STATUSES: dict[CallStatus, frozenset[CallStatus]] = {
    CallStatus.admitted: frozenset({CallStatus.routing}),
    CallStatus.routing: frozenset({CallStatus.prefilling, CallStatus.recovering}),
    CallStatus.prefilling: frozenset({CallStatus.decoding, CallStatus.recovering}),
    CallStatus.decoding: frozenset({CallStatus.finished, CallStatus.recovering}),
    # Fail over (routing), re-prefill, rebuild or fall back (prefilling), or end.
    CallStatus.recovering: frozenset({CallStatus.routing, CallStatus.prefilling, CallStatus.aborted}),
    CallStatus.finished: frozenset(),
    CallStatus.aborted: frozenset(),
    CallStatus.client_gone: frozenset(),
    CallStatus.past_deadline: frozenset(),
}


@dataclass
class Call:
    """One request from arrival to its final frame, with its sampling state; PipelineRun reads and advances it."""

    request: ChatRequest
    model: LoadedModel
    client: ClientStream
    # The roster name of the member who signed the call (None on an open mesh): recorded, never the prompt.
    caller: str | None = None
    # 128 random bits: the pipeline's activation subjects carry it, so it must not be guessable.
    pipeline_id: str = field(default_factory=lambda: new_pipeline_id())
    status: CallStatus = CallStatus.admitted
    started: float = field(default_factory=time.perf_counter)
    prompt_ids: list[int] = field(default_factory=list)
    # Every token sampled (the end-of-sequence token too): what a repaired pipeline re-prefills.
    generated: list[int] = field(default_factory=list)
    # The embedding of the last token sampled: the next decode step's input.
    next_input: torch.Tensor | None = None
    # Set with the last token streamed: the call ends with it (`stop`, `length`).
    finish_reason: str | None = None
    first_token_at: float | None = None
    # How long the call waited in the orchestrator's queue before it started (hearth/services/orchestrator/queue.py).
    queue_wait_s: float | None = None
    construct_ms: float | None = None
    failovers: int = 0
    # tokens_withdrawn frames sent (at most the protocol's max_withdrawals_per_choice: the call ends instead).
    withdrawals: int = 0
    broker_repairs: int = 0
    # Re-prefills on the same chain after a hop answered `session_evicted`.
    eviction_reprefills: int = 0
    # Shards this call routes around (they failed or refused it), each with the failure's words: a call that no
    # chain serves any more says what its shards answered.
    excluded: dict[str, str] = field(default_factory=dict)
    # Shards that reported bad input from the hop before them in this call (hearth/services/orchestrator/chain.py).
    accusers: set[str] = field(default_factory=set)
    # The weight quantization scheme every chain of this call serves: the request's (None: any), then the one
    # its first chain was built on, so a failover keeps greedy output identical.
    quantization: str | None = None
    params: SamplingParams = field(init=False)
    # The call's own random generator (None when greedy): one stream of draws across every chain it runs on.
    generator: torch.Generator | None = field(init=False)
    # The log-probabilities of the token `accept` took last, when the request asked for them.
    last_logprobs: TokenLogprobs | None = field(default=None, init=False)
    # The generator's state before each token was sampled (only while a later check may withdraw tokens), so a
    # call that goes back draws what it would have drawn.
    draw_states: list[torch.Tensor] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.quantization is None:
            self.quantization = self.request.params.quantization
        request = self.request
        self.params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                     seed=request.seed, max_tokens=request.most_tokens, stop=tuple(request.stop),
                                     presence_penalty=request.presence_penalty,
                                     frequency_penalty=request.frequency_penalty,
                                     repetition_penalty=request.repetition_penalty, logit_bias=request.logit_bias,
                                     logprobs=request.logprobs, top_logprobs=request.top_logprobs)
        self.generator = self.params.make_generator()

    @cached_property
    def shaping(self) -> LogitShaping | None:
        """The bias, penalties and log-probabilities of the call's head steps (over its prompt and generated tokens);
        None when it asked for none, so that its steps take the plain path."""
        if self.params.plain and self.grammar is None:
            return None
        return LogitShaping(self.params, self.prompt_ids, self.generated, self.grammar)

    @cached_property
    def output_grammar(self) -> OutputGrammar | None:
        """What the call's output follows (`response_format`, tools); None: free text."""
        return output_grammar(self.request)

    @cached_property
    def grammar(self) -> GrammarState | None:
        """The matcher of the call's output over its generated tokens (None: unconstrained)."""
        constraint = self.output_grammar
        return None if constraint is None else constraint.state(self.model, self.generated)

    @cached_property
    def text_stream(self) -> TextStream:
        """The detokenizer and stop rules of the call's text (made at its first token, from the model's head)."""
        return self.model.head.text_stream(self.params, self.prompt_ids)

    def advance(self, status: CallStatus) -> CallStatus:
        """Move the call to `status` (a no-op when it is there already); the status it left."""
        previous = self.status
        if status is previous:
            return previous
        if status not in CANCELLED_STATUSES and status not in NEXT_STATUSES[previous]:
            raise RuntimeError(f"call {self.pipeline_id}: {previous.value} -> {status.value} is no step of a call")
        if previous.final:
            raise RuntimeError(f"call {self.pipeline_id} already ended {previous.value}")
        self.status = status
        return previous

    def accept(self, token_id: int, embedding: torch.Tensor) -> SampledToken:
        """Take a sampled token into the call: its text through the stop rules, and whether the call ends with it."""
        self.generated.append(token_id)
        self.last_logprobs = self._logprobs_of(token_id)
        delta = self.text_stream.push(token_id)
        text, finish_reason = delta.text, (delta.finish_reason or "stop") if delta.finished else None
        if finish_reason is None and self._grammar_complete():
            text += self.text_stream.finish("stop").text
            finish_reason = self._grammar_finish_reason()
        if finish_reason is None and len(self.generated) >= self.params.max_tokens:
            # Release text held back for a possible stop string together with the last token.
            text += self.text_stream.finish("length").text
            finish_reason = "length"
        return SampledToken(token_id, text, finish_reason, shown=bool(text) or not delta.finished,
                            embedding=embedding)

    def before_sampling(self) -> None:
        """Remember where the random draws stand before the next token is sampled (a rewind returns there)."""
        if self.generator is not None and self.request.params.verify == "sampled":
            self.draw_states.append(self.generator.get_state())

    def rewind(self, keep: int) -> None:
        """Forget every token after the first `keep` (a check refuted the step they came from): the call goes on
        from there as if they never came, its text, penalties and random draws included. The client keeps the
        first `keep` token deltas (a kept token never ended the call, so each gave exactly one)."""
        if not 0 <= keep <= len(self.generated):
            raise ValueError(f"cannot keep {keep} of {len(self.generated)} tokens")
        if self.generator is not None and keep < len(self.draw_states):
            self.generator.set_state(self.draw_states[keep])
        del self.draw_states[keep:]
        del self.generated[keep:]  # in place: the call's LogitShaping reads this very list
        self.finish_reason = None
        self.next_input = None
        self.last_logprobs = None
        self.__dict__.pop("text_stream", None)
        for token_id in self.generated:
            self.text_stream.push(token_id)
        self.client.tokens_sent = keep
        if self.grammar is not None:
            self.grammar.follow()

    def _grammar_complete(self) -> bool:
        """The call's grammar took its last token and allows nothing after it: the output is complete."""
        if self.grammar is None:
            return False
        self.grammar.follow()
        return self.grammar.stopped

    def _grammar_finish_reason(self) -> str:
        reason = self.output_grammar.finish_reason
        # An `auto` answer in text ends `stop`: only an output that opened a tool call is one.
        if reason == FINISH_TOOL_CALLS and not self.text_stream.text.lstrip().startswith("{"):
            return "stop"
        return reason

    def _logprobs_of(self, token_id: int) -> TokenLogprobs | None:
        step = self.shaping.last if self.shaping is not None else None
        if step is None or step.token_id != token_id:
            return None
        head = self.model.head
        # A log-probability of -infinity (JSON has none) is reported as OpenAI does: the frames' Logprob reads it as
        # hearth.protocol.bounds.lowest_logprob.
        return TokenLogprobs(text=head.token_text(token_id), logprob=step.logprob, top_logprobs=[
            TokenAlternative(token_id=alternative, text=head.token_text(alternative), logprob=logprob)
            for alternative, logprob in step.top])

    @property
    def known_ids(self) -> list[int]:
        """The prompt and everything generated: the input of a (re-)prefill."""
        return self.prompt_ids + self.generated

    @property
    def next_position(self) -> int:
        """The position of the last token sampled, which the next decode step feeds in."""
        return len(self.prompt_ids) + len(self.generated) - 1

    @property
    def completion_tokens(self) -> int:
        """Tokens the client received (an end-of-sequence token that produced no text is not one)."""
        return self.client.tokens_sent

    def seconds_since_start(self) -> float:
        return time.perf_counter() - self.started

    def queue_wait_ms(self) -> float | None:
        return None if self.queue_wait_s is None else self.queue_wait_s * 1000.0

    def ttft_ms(self) -> float:
        return ((self.first_token_at or time.perf_counter()) - self.started) * 1000.0

    def decode_tokens_per_second(self) -> float:
        decode_s = time.perf_counter() - (self.first_token_at or self.started)
        tokens = self.completion_tokens
        return (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
