"""Admission of a valid request against its model: the prompt is tokenized only when it can fit the model's
context, its tokens plus `max_tokens` must fit (without `max_tokens`, plus one: the answer then runs to the
default or the context's end, whichever comes first), and every refusal is a BadRequest naming the fields.

Two moments, so that tokenizing waits its turn: `prompt_room` is cheap and is checked as a request arrives;
`admit_prompt` tokenizes and is called once the call's turn in the fair queue came (hearth/services/orchestrator/
queue.py), so one caller's long prompts and large templates never run ahead of other callers' calls.

Why a bound before tokenizing: tokenizing a 1 M-character prompt takes seconds, and a prompt that long could
never fit a context anyway. TokenLowerBound says, in one pass of the normalizer, how many tokens the text needs
at least; beyond the room the context leaves, the request is refused without tokenizing it.
"""

from __future__ import annotations

from collections.abc import Iterator

from jinja2 import TemplateError

from hearth.inference import Head, InferenceError
from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.chat import BadRequest, ChatRequest
from hearth.protocol.refusals import CONTEXT_EXCEEDED
from hearth.services.orchestrator.catalog import LoadedModel
from hearth.services.orchestrator.constrained import output_grammar

# A chat template's own error message is the client's to read, but only its start.
template_error_chars = 300
# Control tokens written as text in a request's messages are each encoded on their own (hearth/inference/head.py
# `encode_chat`), several times the cost of plain text; a request writing more is refused before tokenizing.
max_control_tokens_in_messages = 1024
# The exceptions tokenizing a client's text can raise because of that text (anything else is our bug).
_INPUT_ERRORS = (TemplateError, InferenceError, ValueError, TypeError, RecursionError)


def prompt_room(request: ChatRequest, model: LoadedModel) -> int | None:
    """The tokens the model's context leaves for the prompt (None: unknown), or BadRequest when `max_tokens`
    leaves none, `logit_bias` names a token the model does not have or no grammar can be made of `response_format`
    or `tools`; no tokenizing."""
    output_grammar(request)
    vocab_size = model.head.info.vocab_size
    beyond = sorted(token_id for token_id in request.logit_bias if token_id >= vocab_size)
    if beyond:
        raise BadRequest(f"field 'logit_bias.{beyond[0]}': token id {beyond[0]} is not in the model's vocabulary of "
                         f"{vocab_size} tokens", param="logit_bias")
    context = model.context_length
    # Without max_tokens the answer takes what the context leaves (ChatRequest.fitted_to_context): one token at least.
    answer_tokens = 1 if request.max_tokens is None else request.max_tokens
    room = None if context is None else context - answer_tokens
    if room is not None and room < 1 and request.max_tokens is not None:
        raise BadRequest(f"field 'max_tokens': max_tokens {request.max_tokens} leaves no room for a prompt: with one "
                         f"prompt token they {CONTEXT_EXCEEDED} of {context} tokens", param="max_tokens",
                         reason="context_exceeded")
    return room


async def admit_prompt(request: ChatRequest, model: LoadedModel) -> list[int]:
    """The request's prompt token ids, or BadRequest when its prompt cannot be served with this model."""
    field = "messages" if request.messages is not None else "prompt"
    context = model.context_length
    room = prompt_room(request, model)
    prompt_ids, at_least = await on_compute_thread(_tokenize_within, request, model, room)
    grammar = output_grammar(request)
    if grammar is not None:
        # Compiling reads the model's whole vocabulary the first time: on the compute thread too.
        await on_compute_thread(grammar.check, model)
    if prompt_ids is None:
        raise _too_long(request, field, context, at_least, exact=False)
    if not prompt_ids:
        raise BadRequest(f"field '{field}': the prompt encodes to no tokens", param=field)
    if room is not None and len(prompt_ids) > room:
        raise _too_long(request, field, context, len(prompt_ids), exact=True)
    return prompt_ids


def _too_long(request: ChatRequest, field: str, context: int | None, tokens: int, *, exact: bool) -> BadRequest:
    """The refusal of a prompt of `tokens` (exactly, or at least) that leaves its answer no room in `context`."""
    counted = str(tokens) if exact else f"at least {tokens}"
    if request.max_tokens is None:
        return BadRequest(f"field '{field}': the prompt's {counted} tokens leave no room for an answer: they and one "
                          f"token more {CONTEXT_EXCEEDED} of {context} tokens", param=field, reason="context_exceeded")
    total = f" = {tokens + request.max_tokens}" if exact else ""
    return BadRequest(f"fields '{field}' and 'max_tokens': the prompt's {counted} tokens plus max_tokens "
                      f"{request.max_tokens}{total} {CONTEXT_EXCEEDED} of {context} tokens", param=field,
                      reason="context_exceeded")


def _tokenize_within(request: ChatRequest, model: LoadedModel, room: int | None) -> tuple[list[int] | None, int]:
    """On the compute thread: (token ids, 0), or (None, the tokens the prompt needs at least) when that lower
    bound already exceeds `room` and tokenizing would be wasted."""
    head = model.head
    field = "messages" if request.messages is not None else "prompt"
    try:
        messages = [m.for_template() for m in request.messages] if request.messages is not None else None
    except _INPUT_ERRORS as error:
        raise BadRequest(f"field 'messages': {type(error).__name__}: {str(error)[:template_error_chars]}",
                         param="messages") from None
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    if not head.has_tokenizer:
        raise BadRequest(f"field 'model': model {model.model_id} has no tokenizer on this orchestrator",
                         param="model")
    if messages is not None and not getattr(head.tokenizer, "chat_template", None):
        raise BadRequest(f"field 'messages': model {model.model_id} has no chat template; send 'prompt' instead",
                         param="messages")
    if messages is not None:
        _refuse_control_tokens(head, messages, tools)
    try:
        if messages is not None:
            text = head.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        else:
            text = request.prompt
        at_least = model.token_bound.at_least(text) if model.token_bound is not None else 0
        if room is not None and at_least > room:
            return None, at_least
        ids = head.encode_chat(messages, tools=tools) if messages is not None else head.encode_prompt(text)
    except _INPUT_ERRORS as error:
        first_line = (str(error).splitlines() or [type(error).__name__])[0][:template_error_chars]
        raise BadRequest(f"field '{field}': the model's tokenizer or chat template refused it: {first_line}",
                         param=field) from None
    # A tokenizer may know tokens the model has no embedding for (Ollama's Gemma 3 files list image tokens beyond it).
    if ids and (beyond := max(ids)) >= model.head.info.vocab_size:
        raise BadRequest(f"field '{field}': it encodes to token {beyond}, which model {model.model_id} has no "
                         f"embedding for (it has {model.head.info.vocab_size})", param=field)
    return list(ids), 0


def _refuse_control_tokens(head: Head, messages: list[dict], tools: list[dict] | None) -> None:
    """Refuse a request writing more control tokens as text than max_control_tokens_in_messages, or any in a key:
    templates get the values of messages (tool calls' arguments among them) with control tokens marked as text, but
    the keys of arguments and of tools' parameters as they are, so a control token there would forge a turn."""
    written = head.control_tokens_in(_json_parts(messages, keys=False))
    if written > max_control_tokens_in_messages:
        raise BadRequest(f"field 'messages': {written} control tokens of the chat template written as text, more than "
                         f"{max_control_tokens_in_messages}", param="messages")
    if head.control_tokens_in(_json_parts([messages, tools], keys=True)):
        raise BadRequest("fields 'messages' and 'tools': a key of a tool call's arguments or of a tool's parameters "
                         "writes a control token of the chat template", param="messages")


def _json_parts(value, *, keys: bool) -> Iterator[str]:
    """The keys (`keys`) or the string values of JSON-like `value`, however deep (without recursing)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if keys:
                yield from (key for key in item if isinstance(key, str))
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, str) and not keys:
            yield item
