"""`hearth chat` and `hearth models`: one chat request, or the mesh's models, from the command line."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from hearth.services.client.answer_bound import AnswerBound, AnswerTooLong, warn_answer_too_long
from hearth.services.client.chat import AnswerTokens, ModelsRefused, choice_of, list_models, stream_chat
from hearth.services.client.pinned import answered_by, stream_chat_pinned
from hearth.protocol.display_text import display_text
from hearth.protocol.chat import (ChatMessage, ChatParams, ChatRequest, default_max_tokens, describe_validation_error,
                                  max_prompt_chars)
from hearth.protocol.chat_frames import (
    ChatFrame,
    DoneFrame,
    ErrorFrame,
    PipelineAbortedFrame,
    QueuedFrame,
    TokenDeltaFrame,
    TokensWithdrawnFrame,
)
from hearth.protocol.subjects import MODELS_REQUEST_SUBJECT
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.common.lifecycle import run_event_loop
from hearth.services.broker.connection import BrokerUnreachable, close_quietly, connect_nats

EXIT_ERROR = 1
EXIT_NO_ANSWER = 2
# A request refused as not valid (bad_request), here or by the mesh: the caller's input, as a usage error is (as
# services.cli_options.EXIT_BAD_INPUT, which this package may not import).
EXIT_BAD_REQUEST = 2
# What a request asks for when it does not say: one choice.
requested_choices = ChatRequest.model_fields["n"].default
# The PROMPT that says: read it from stdin.
PROMPT_FROM_STDIN = "-"


def prompt_from_stdin(interactive: bool) -> str:
    """The prompt given as `-`: all of stdin (with `interactive`, its first line: the lines after it are the next
    turns), without its last line end. Read here rather than given on the command line, where every user of the
    machine sees it (ps, /proc/PID/cmdline) and a shell's history keeps it. At most one character past what a
    request may carry is read: the request's own check refuses a longer one."""
    text = sys.stdin.readline(max_prompt_chars + 1) if interactive else sys.stdin.read(max_prompt_chars + 1)
    return text.removesuffix("\n")


def run_chat_command(nats_url: str, *, prompt: str, model: str | None, max_tokens: int | None, temperature: float,
                     seed: int | None, raw: bool, as_json: bool, choices: int,
                     nats_settings: NatsSettings | None = None, quantization: str | None = None,
                     interactive: bool = False, waits: dict[str, float] | None = None) -> int:
    """`hearth chat`: stream one answer to stdout, everything else one line each to stderr; with `choices` > 1
    (the request's `n`), each choice's answer is printed once the call ended, under a `[choice I]` line.

    A `done` frame whose `verification` is `unmet` ends its summary line on stderr with `, verification unmet`.

    Exit code 0 on `done`; 2 on a request refused as not valid (here, or a `bad_request` frame from the mesh: the
    caller's input); 1 on any other error frame or an answer past its bound (AnswerBound); 2 when no answer came in
    time (NATS not reachable within nats.connect_timeout_s, or no orchestrator answering).

    Text already printed cannot be taken back: when a tokens_withdrawn frame comes, the line ends, a
    `[tokens_withdrawn ...]` line goes to stderr, and the answer's kept text is printed again on stdout, where
    the text goes on; the last stretch of stdout after such a line is the answer.

    With `interactive`, each line then read from stdin is the conversation's next turn (an empty line or EOF ends
    it, exit code 0), sent to the orchestrator that answered the last turn (hearth/services/client/pinned.py).
    `waits`: stream_chat's timeouts (chat.configured_waits), else their defaults.
    """
    if prompt == PROMPT_FROM_STDIN:
        prompt = prompt_from_stdin(interactive)
    try:  # the request's own field checks the label (QuantizationLabel); its refusal names the option given
        params = ChatParams(quantization=quantization)
    except ValidationError as error:
        _say(f"error bad_request: --quantization {error.errors(include_url=False)[0]['msg']}")
        return EXIT_BAD_REQUEST
    if interactive and (raw or as_json or choices != requested_choices):
        _say("error bad_request: --interactive goes on with a conversation of messages: not with --raw, --json or --n")
        return EXIT_BAD_REQUEST
    try:
        request = ChatRequest(model=model, max_tokens=max_tokens, temperature=temperature, seed=seed, n=choices,
                              params=params,
                              **({"prompt": prompt} if raw else
                                 {"messages": [ChatMessage(role="user", content=prompt)]}))
    except ValidationError as error:
        _say(f"error bad_request: {describe_validation_error(error)}")
        return EXIT_BAD_REQUEST
    if interactive:
        return run_event_loop(_conversation(nats_url, request, nats_settings=nats_settings, waits=waits))
    return run_event_loop(_chat(nats_url, request, as_json=as_json, nats_settings=nats_settings, waits=waits))


async def _chat(nats_url: str, request: ChatRequest, *, as_json: bool, nats_settings: NatsSettings | None,
                waits: dict[str, float] | None = None) -> int:
    try:
        nc = await connect_nats(nats_url, name="hearth-chat", settings=nats_settings, wait_for_broker=False)
    except BrokerUnreachable as error:
        _say(f"hearth chat: {error}")
        return EXIT_NO_ANSWER
    printer = ChatPrinter.of(request)
    try:
        # aclosing: the inbox is unsubscribed here, before the connection closes, not by a finalizer later.
        async with contextlib.aclosing(stream_chat(nc, request, **(waits or {}))) as frames:
            async for frame in frames:
                if as_json:
                    exit_code = printer.past_bound(frame)
                    if exit_code is not None:
                        return exit_code
                    print(frame.model_dump_json(exclude_none=True), flush=True)
                    continue
                exit_code = printer.show(frame)
                if exit_code is not None:
                    return exit_code
        return 0
    finally:
        await close_quietly(nc, (nats_settings or NatsSettings()).close_timeout_s)


async def _conversation(nats_url: str, request: ChatRequest, *, nats_settings: NatsSettings | None,
                        waits: dict[str, float] | None = None) -> int:
    """`hearth chat --interactive`: `request`'s turn, then one turn per line of stdin, each sent to the orchestrator
    that answered the one before (its member's hops keep the history's KV)."""
    try:
        nc = await connect_nats(nats_url, name="hearth-chat", settings=nats_settings, wait_for_broker=False)
    except BrokerUnreachable as error:
        _say(f"hearth chat: {error}")
        return EXIT_NO_ANSWER
    messages, orchestrator = list(request.messages), None
    try:
        while True:
            turn = request.model_copy(update={"messages": messages, "request_id": uuid.uuid4().hex})
            printer = ChatPrinter.of(turn, asked_first=orchestrator)
            frames_of_turn = stream_chat_pinned(nc, turn, orchestrator=orchestrator, **(waits or {}))
            async with contextlib.aclosing(frames_of_turn) as frames:
                async for frame in frames:
                    exit_code = printer.show(frame)
                    if exit_code is not None:
                        return exit_code
                    orchestrator = answered_by(frame) or orchestrator
            messages.append(ChatMessage(role="assistant", content=printer.answer.text))
            line = await asyncio.to_thread(sys.stdin.readline)  # off the event loop: stdin blocks
            if not line.strip():
                return 0
            try:
                messages.append(ChatMessage(role="user", content=line.rstrip("\n")))
            except ValidationError as error:  # a line no message may carry (too long; bytes that are not UTF-8)
                _say(f"error bad_request: {describe_validation_error(error)}")
                return EXIT_BAD_REQUEST
    finally:
        await close_quietly(nc, (nats_settings or NatsSettings()).close_timeout_s)


class ChatPrinter:
    """Prints one call's frames: the text to stdout as it streams, every other thing one line each to stderr
    (the text's line ended first). With `choices` > 1 the choices' texts interleave on the wire, so each is
    printed whole, under a `[choice I]` line, once the call is done. A choice whose answer grows past what the
    request allows (AnswerBound) ends the call with an error line (and a WARNING naming the orchestrator)."""

    def __init__(self, choices: int = requested_choices, *, max_tokens: int = default_max_tokens,
                 request_id: str = "", asked_first: str | None = None) -> None:
        self.answers = [AnswerTokens(choice=choice) for choice in range(choices)]
        self.line_open = False
        self.bound = AnswerBound(max_tokens, choices)
        # What the WARNING of an answer past its bound names: the call, and the orchestrator it was sent to first.
        self.request_id, self.asked_first = request_id, asked_first

    @classmethod
    def of(cls, request: ChatRequest, asked_first: str | None = None) -> "ChatPrinter":
        return cls(request.n, max_tokens=request.most_tokens, request_id=request.request_id, asked_first=asked_first)

    @property
    def answer(self) -> AnswerTokens:
        return self.answers[0]

    def past_bound(self, frame: ChatFrame) -> int | None:
        """EXIT_ERROR, its error line printed, once `frame` takes its choice's answer past the request's bound."""
        try:
            self.bound.take(frame)
        except AnswerTooLong as error:
            warn_answer_too_long(error, self.request_id, self.asked_first)
            self._end_line()
            _say(f"error answer_too_long: {error}")
            return EXIT_ERROR
        return None

    def show(self, frame: ChatFrame) -> int | None:
        """Print `frame`; the exit code once an error frame ended the call (or a frame past the request's bound),
        None otherwise."""
        exit_code = self.past_bound(frame)
        if exit_code is not None:
            return exit_code
        choice = choice_of(frame)
        withdrawn = self.answers[choice].take(frame) if choice < len(self.answers) else []
        streams = len(self.answers) == 1
        if isinstance(frame, TokenDeltaFrame):
            if streams:
                self._write(frame.text)
        elif isinstance(frame, TokensWithdrawnFrame):
            self._end_line()
            whose = "" if streams else f" of choice {choice}"
            _say(f"[tokens_withdrawn: the {len(withdrawn)} tokens{whose} after token {frame.kept_tokens} are taken "
                 f"back ({frame.shard_id}: {frame.reason}); the answer so far:]")
            if streams:
                self._write(self.answer.text)
        elif isinstance(frame, DoneFrame):
            timing = frame.timing
            if not streams:
                self._print_choices(frame)
            self._end_line()
            # One summary line: a mesh without replicas has every call unmet, and a line each would be noise.
            unmet = ", verification unmet" if frame.verification == "unmet" else ""
            _say(f"[{frame.finish_reason}: {frame.usage.completion_tokens} tokens, "
                 f"{timing.tokens_per_second or 0:.1f} tokens/s, ttft {timing.ttft_ms or 0:.0f} ms{unmet}]")
        elif isinstance(frame, QueuedFrame):
            _say(f"[queued: position {frame.position} of {frame.queued_requests}]")
        elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
            message = frame.message if isinstance(frame, ErrorFrame) else frame.reason
            if isinstance(frame, ErrorFrame) and frame.retry_after_s is not None:
                message += f" (retry after {frame.retry_after_s:g} s)"
            if choice:
                message += f" (choice {choice})"
            self._end_line()
            _say(f"error {frame.code}: {message}")
            # No orchestrator answered, or it went silent: no answer in time, as for a broker away.
            if frame.code == "orchestrator_gone":
                return EXIT_NO_ANSWER
            return EXIT_BAD_REQUEST if frame.code == "bad_request" else EXIT_ERROR
        elif frame.type in ("shard_status", "shard_failover"):
            self._end_line()
            _say(f"[{frame.type}: {frame.model_dump_json(exclude={'seq', 'type'})}]")
        return None

    def _print_choices(self, done: DoneFrame) -> None:
        endings = {end.choice: end for end in done.choices or []}
        for answer in self.answers:
            end = endings.get(answer.choice)
            how = f": {end.finish_reason}, {end.completion_tokens} tokens" if end is not None else ""
            self._end_line()
            self._write(f"[choice {answer.choice}{how}]\n")
            self.line_open = False
            self._write(answer.text)

    def _write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.line_open = self.line_open or bool(text)

    def _end_line(self) -> None:
        """Finish the text's line before a status line goes to stderr."""
        if self.line_open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.line_open = False


def _say(line: str) -> None:
    # Error and status lines carry text other members wrote (a shard's refusal, say): escaped, one line each.
    print(display_text(line), file=sys.stderr, flush=True)


def run_models_command(nats_url: str, *, as_json: bool, settings: HearthSettings) -> int:
    """`hearth models`: print what `llm.models` answers; exit code 0, or 2 when no answer came."""
    return run_event_loop(_models(nats_url, as_json=as_json, settings=settings))


async def _models(nats_url: str, *, as_json: bool, settings: HearthSettings) -> int:
    try:
        nc = await connect_nats(nats_url, name="hearth-models", settings=settings.nats, wait_for_broker=False)
    except BrokerUnreachable as error:
        _say(f"hearth models: {error}")
        return EXIT_NO_ANSWER
    try:
        reply = await list_models(nc, settings.client.first_frame_timeout_s)
    except NoRespondersError:
        _say(f"hearth models: no orchestrator is listening on {MODELS_REQUEST_SUBJECT}")
        return EXIT_NO_ANSWER
    except NatsTimeoutError:
        _say(f"hearth models: no orchestrator answered within {settings.client.first_frame_timeout_s:g} s")
        return EXIT_NO_ANSWER
    except ModelsRefused as refused:
        _say(f"hearth models: the orchestrator refused: {refused}")
        return EXIT_NO_ANSWER
    finally:
        await close_quietly(nc, settings.nats.close_timeout_s)
    if as_json:
        print(reply.model_dump_json(indent=2))
        return 0
    print(f"{'model':32s} {'layers covered':24s} {'complete':8s} {'context':>8s}  local  quantizations")
    for model in reply.models:
        covered = ", ".join(f"{lo}-{hi}" for lo, hi in model.covered_layers) or "-"
        print(display_text(f"{model.id:32s} {covered + f' of {model.total_layers}':24s} "
                           f"{'yes' if model.complete else 'no':8s} {model.context_length or '?':>8}  "
                           f"{'yes' if model.runnable_locally else 'no':5s}  {', '.join(model.quantizations) or '-'}"))
    print(f"default model: {reply.default_model or '(none: name one with --model)'}")
    return 0
