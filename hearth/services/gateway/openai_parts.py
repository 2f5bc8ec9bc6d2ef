"""The objects nested in an OpenAI request body (a message, its content parts and tool calls, a tool, `tool_choice`,
`stream_options`, `prediction`, `prompt_cache_options`), each refusing a key OpenAI's API does not know, and that
refusal in OpenAI's words (UnknownParameter), naming the key by its path in the body.

Every key the pinned openai client may send is declared, so it is accepted: what hearth reads; what changes nothing
here (a message's `name`, a part's `prompt_cache_breakpoint`, `stream_options.include_obfuscation`); and what hearth
cannot honour (a custom tool, an assistant's earlier `audio`), refused by name when mapped, never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError

from hearth.protocol.chat import BadRequest, ChatMessage
from hearth.protocol.chat_tools import (
    ClosedObject, FunctionCall, FunctionDefinition, FunctionName, NamedToolChoice, Tool, max_tool_call_id_chars,
    max_tool_calls_per_message, max_tools,
)
from hearth.protocol.refusals import RefusalReason, max_param_chars

Item = TypeVar("Item")
# A list whose first wrong item ends its validation: a body of many wrong items is refused for one, not described
# item by item (a 1 MB body of them drew tens of MB of error, built on the event loop).
FailFastList = Annotated[list[Item], Field(fail_fast=True)]
# A label OpenAI's API takes from a short list (a part's type, a cache mode): bounded, as a list may grow.
Label = Annotated[str, Field(max_length=64)]
# OpenAI's pattern and bound for a participant's `name`.
ParticipantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$", max_length=64)]
ToolCallId = Annotated[str, Field(min_length=1, max_length=max_tool_call_id_chars)]
# OpenAI's bounds of `metadata`: 16 pairs, keys of 64 characters, values of 512.
max_metadata_pairs = 16


def _pairs_counted_first(value: Any) -> Any:
    # A dict's max_length is checked after its entries: one of many wrong entries would be refused entry by entry.
    if isinstance(value, dict) and len(value) > max_metadata_pairs:
        raise ValueError(f"at most {max_metadata_pairs} pairs (got {len(value)})")
    return value


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=max_metadata_pairs), BeforeValidator(_pairs_counted_first)]


class Unsupported(BadRequest):
    """A request field hearth refuses (one it cannot honour, or a value it does not take); `param` names it."""

    def __init__(self, param: str | None, message: str, reason: RefusalReason | None = None) -> None:
        super().__init__(message, param=param, reason=reason)


class UnknownParameter(Unsupported):
    """A key OpenAI's API does not know, which OpenAI's API refuses too (answered with its code, unknown_parameter);
    `param` is its path (`messages[0].conten`), None when too long to carry."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(path if len(path) <= max_param_chars else None, message)


def shortened(name: str) -> str:
    """A name of the client's own, cut to what a message quotes."""
    return name if len(name) <= max_param_chars else name[:max_param_chars] + "..."


def unknown_parameter(error: ValidationError, body: bytes | bytearray | dict[str, Any]) -> UnknownParameter | None:
    """The refusal of the first key `error` found that no model declares, in OpenAI's words, with its path in
    `body` (the JSON validated, or its object); None when it found none."""
    location = next((item["loc"] for item in error.errors(include_url=False) if item["type"] == "extra_forbidden"),
                    None)
    if location is None:
        return None
    try:
        data = json.loads(body) if isinstance(body, (bytes, bytearray)) else body
    except ValueError:
        data = _UNREAD
    path = _path_in(data, location)
    return UnknownParameter(path, f"Unknown parameter: '{shortened(path)}'.")


_UNREAD = object()  # a body that could not be read again


def _path_in(data: Any, location: Sequence[str | int]) -> str:
    """`location` (pydantic's) as OpenAI writes a path, `messages[0].content[1].text`: only the keys and indices
    `data` holds, leaving out the labels pydantic adds for a union's members."""
    path = ""
    for part in location:
        if isinstance(data, dict) and isinstance(part, str) and part in data:
            path += f".{part}" if path else part
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            path += f"[{part}]"
            data = data[part]
        elif data is _UNREAD:  # every part as it is
            path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


class _Closed(ClosedObject):
    """An object of OpenAI's request: a key it does not declare is refused (unknown_parameter)."""


class CacheHint(_Closed):
    """`prompt_cache_breakpoint` of a content part, `prompt_cache_options`: hints for OpenAI's own prompt cache,
    accepted, changing nothing."""

    mode: Label | None = None
    ttl: Label | None = None


class ContentPart(_Closed):
    """One part of a message's content given as a list: hearth reads `text` parts (and an assistant's `refusal`);
    any other type (`image_url`, `input_audio`, `file`) is refused by name when mapped."""

    type: Label
    text: str | None = None
    refusal: str | None = None
    # What parts of the types hearth refuses carry (so that they are refused by type, not as unknown).
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    prompt_cache_breakpoint: CacheHint | None = None

    def text_of(self, role: str, where: str) -> str:
        """The part's text; Unsupported naming `where` (messages.I.content.J) when hearth cannot read it."""
        if self.type == "text" and self.text is not None:
            return self.text
        if self.type == "refusal" and role != "assistant":
            raise Unsupported("messages", f"{where}: only an assistant's message may hold a 'refusal' part")
        if self.type == "refusal" and self.refusal is not None:
            return self.refusal
        if self.type in ("text", "refusal"):
            raise Unsupported("messages", f"{where}: a '{self.type}' part needs its '{self.type}' string")
        raise Unsupported("messages", f"{where}: content parts of type {self.type!r} are not supported by hearth: "
                                      "its models read text only ('text' parts)")


def _text_or_parts(content: Any) -> str | None:
    return "text" if isinstance(content, str) else "parts" if isinstance(content, list) else None


# A message's content, a string or a list of parts; which one is told by its type first, so that a refusal names
# what is wrong with it, not also why it is not the other.
TextOrParts = Annotated[Annotated[str, Tag("text")] | Annotated[FailFastList[ContentPart], Tag("parts")],
                        Discriminator(_text_or_parts, custom_error_type="text_or_parts",
                                      custom_error_message="Input should be a string or a list of content parts")]


def _no_custom_tools(where: str) -> Unsupported:
    return Unsupported(where.split(".", 1)[0], f"{where}: custom tools are not supported by hearth: its tools are "
                                               "functions ('type': 'function')")


class OpenAIToolCall(_Closed):
    """A call an assistant message of the history made: a function's, or a custom tool's (refused when mapped)."""

    id: ToolCallId
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: dict[str, Any] | None = None

    def to_tool_call(self, where: str) -> dict[str, Any]:
        if self.type == "custom":
            raise _no_custom_tools(where)
        if self.function is None:
            raise Unsupported("messages", f"{where}: a 'function' tool call needs its 'function'")
        return {"id": self.id, "function": self.function}


class OpenAIMessage(_Closed):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: TextOrParts | None = None
    # The participant's name: accepted and left out (the chat templates hearth applies have no place for it).
    name: ParticipantName | None = None
    # An assistant's refusal, read as its text (as a 'refusal' part is).
    refusal: str | None = None
    tool_calls: Annotated[list[OpenAIToolCall], Field(fail_fast=True, max_length=max_tool_calls_per_message)] | \
        None = None
    tool_call_id: ToolCallId | None = None
    # An assistant's earlier audio answer, and its call of the deprecated `functions`: refused when given.
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def to_chat_message(self, index: int = 0) -> ChatMessage:
        """hearth's message; `index`: this one's place in `messages`, which a refusal names."""
        where = f"messages.{index}"
        if self.role == "function":
            raise Unsupported("messages", f"{where}: messages of role 'function' (of the deprecated 'functions') are "
                                          "not supported by hearth: send 'tool' messages")
        if self.audio is not None:
            raise Unsupported("messages", f"{where}.audio: audio is not supported by hearth: its answers are text")
        if self.function_call is not None:
            raise Unsupported("messages", f"{where}.function_call: calls of the deprecated 'functions' are not "
                                          "supported by hearth: send 'tool_calls'")
        if self.refusal is not None and self.role != "assistant":
            raise Unsupported("messages", f"{where}: only an assistant's message may hold a 'refusal'")
        content = self.content if isinstance(self.content, str) else "".join(
            part.text_of(self.role, f"{where}.content.{number}") for number, part in enumerate(self.content or []))
        # A developer message is what newer OpenAI models call a system message.
        fields: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                  "content": content + (self.refusal or "")}
        if self.tool_calls:
            fields["tool_calls"] = [call.to_tool_call(f"{where}.tool_calls.{number}")
                                    for number, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        return ChatMessage(**fields)


class OpenAITool(_Closed):
    """A tool of `tools`: a function (hearth's Tool), or a custom tool (refused when mapped)."""

    type: Literal["function", "custom"] = "function"
    function: FunctionDefinition | None = None
    custom: dict[str, Any] | None = None

    def to_tool(self, index: int) -> Tool:
        if self.type == "custom":
            raise _no_custom_tools(f"tools.{index}")
        if self.function is None:
            raise Unsupported("tools", f"tools.{index}: a 'function' tool needs its 'function'")
        return Tool(function=self.function)


OpenAITools = Annotated[list[OpenAITool], Field(fail_fast=True, max_length=max_tools)]


class OpenAIToolChoice(_Closed):
    """`tool_choice` as an object: a named function (hearth's NamedToolChoice); `allowed_tools` or a named custom
    tool are refused when mapped."""

    type: Literal["function", "allowed_tools", "custom"] = "function"
    function: FunctionName | None = None
    allowed_tools: dict[str, Any] | None = None
    custom: dict[str, Any] | None = None

    def to_named_tool_choice(self) -> NamedToolChoice:
        if self.type == "allowed_tools":
            raise Unsupported("tool_choice", "tool_choice: 'allowed_tools' is not supported by hearth: send only the "
                                             "tools allowed in 'tools'")
        if self.type == "custom":
            raise _no_custom_tools("tool_choice")
        if self.function is None:
            raise Unsupported("tool_choice", "tool_choice: a 'function' choice needs its 'function'")
        return NamedToolChoice(function=self.function)


class StreamOptions(_Closed):
    include_usage: bool | None = None
    # OpenAI's random padding of stream chunks (against reading their sizes): hearth adds none, so it changes nothing.
    include_obfuscation: bool | None = None


class Prediction(_Closed):
    """`prediction`: text OpenAI's models may reuse to answer faster; accepted, changes nothing."""

    type: Literal["content"]
    content: TextOrParts
