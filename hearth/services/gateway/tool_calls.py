"""Tool calls in OpenAI's form, from the text of an answer that called a tool: hearth's models answer a call as the
compact JSON object ``{"name": ..., "arguments": {...}}`` (hearth/services/orchestrator/constrained.py), which the
gateway turns into `tool_calls` (one call, id `call_<hex>`) of the whole answer, or streams as OpenAI does: the call's
id and function name first, then its arguments in fragments as they come, and finish_reason `tool_calls`. A call cut
short (`max_tokens`: finish_reason `length`) is, streamed and whole alike, the call with its arguments as far as they
came once they began, as OpenAI's are, and before that its text: no name is sure until the arguments start."""

from __future__ import annotations

import json
import uuid

from pydantic import BaseModel, Field

_ARGUMENTS_KEY = '"arguments":'


class FunctionCallBody(BaseModel):
    # Left out, not null, in a streamed fragment after the first, as OpenAI sends them.
    name: str | None = Field(default=None, exclude_if=lambda value: value is None)
    arguments: str


class ToolCallBody(BaseModel):
    """`message.tool_calls[]` of a whole answer, and (with `index`; id, type and name only in the first) each
    streamed fragment's `delta.tool_calls[]`."""

    index: int | None = Field(default=None, exclude_if=lambda value: value is None)
    id: str | None = Field(default=None, exclude_if=lambda value: value is None)
    type: str | None = Field(default=None, exclude_if=lambda value: value is None)
    function: FunctionCallBody


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_so_far(text: str) -> ToolCallBody | None:
    """The call a cut answer's text makes as a stream sends it (None: the text is no call, or one cut before its
    arguments began)."""
    stream = ToolCallStream()
    fragments = stream.take(text)[1] + stream.finish()[1]
    if not fragments:
        return None
    return ToolCallBody(id=stream.id, type="function", function=FunctionCallBody(
        name=fragments[0].function.name, arguments="".join(fragment.function.arguments for fragment in fragments)))


def tool_call_of(text: str) -> ToolCallBody | None:
    """The tool call an answer's text makes (None: the text is no call)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return ToolCallBody(id=new_tool_call_id(), type="function",
                        function=FunctionCallBody(name=call["name"], arguments=json.dumps(call["arguments"])))


def _is_whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallStream:
    """Splits a streamed answer into text or one tool call by its first character, as the orchestrator's grammar
    does (hearth/services/orchestrator/constrained.py): an answer opening with ``{`` is a call, whose name goes out
    once its arguments start and whose arguments go out as they come (all but the object's closing brace, which only
    the end may release); one opening with anything else, a blank included, is text, sent as it comes."""

    def __init__(self) -> None:
        self.is_call: bool | None = None
        self.text = ""
        self._sent_arguments_to = 0
        self._name_sent = False
        self.id = new_tool_call_id()

    def take(self, text: str) -> tuple[str, list[ToolCallBody]]:
        """Text to send as content, and tool-call fragments to send, for the answer's next piece of text."""
        self.text += text
        if self.is_call is None and self.text:
            # Not after blanks: a text answer may open with " {" (the grammar's text is anything but "{" first).
            self.is_call = self.text.startswith("{")
        if not self.is_call:
            return text, []
        return "", self._fragments(final=False)

    def finish(self) -> tuple[str, list[ToolCallBody]]:
        """What is still held back when the answer ends: a call cut before its arguments is its text."""
        if self.is_call:
            if _ARGUMENTS_KEY not in self.text:
                return self.text, []
            return "", self._fragments(final=True)
        return "", []  # text went out as it came

    def _fragments(self, *, final: bool) -> list[ToolCallBody]:
        start = self.text.find(_ARGUMENTS_KEY)
        if start < 0:
            return []
        fragments = []
        if not self._name_sent:
            try:
                name = json.loads(self.text[self.text.index(":") + 1:start].strip().rstrip(","))
            except ValueError:
                name = None
            fragments.append(ToolCallBody(index=0, id=self.id, type="function",
                                          function=FunctionCallBody(name=str(name), arguments="")))
            self._name_sent = True
            self._sent_arguments_to = start + len(_ARGUMENTS_KEY)
        # All but the last character, which may be the object's closing brace (no part of the arguments); at the
        # end, all but that brace, or all of it for a call cut short, which has none.
        if not final:
            end = len(self.text) - 1
        else:
            end = len(self.text.rstrip()) - 1 if _is_whole_json(self.text) else len(self.text)
        if end > self._sent_arguments_to:
            fragments.append(ToolCallBody(index=0, function=FunctionCallBody(
                arguments=self.text[self._sent_arguments_to:end])))
            self._sent_arguments_to = end
        return fragments
