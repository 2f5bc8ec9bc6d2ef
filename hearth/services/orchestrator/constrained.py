"""What grammar a call's output follows (`response_format`, `tools` and `tool_choice` of its request), checked when
the call is admitted and made into the call's matcher (hearth/inference/grammar.py) at its first head step.

- `json_object`: any JSON object; `json_schema`: JSON valid against the schema; both compact (no optional spaces);
- `tools` with `tool_choice` `required`: a tool call of one of the tools, ``{"name": ..., "arguments": {...}}`` with
  arguments valid against that tool's `parameters`; a named function: a call of that one;
- `auto` (the default with tools): either text that does not start with ``{`` or a tool call as above;
- `none`, or no option at all: no grammar.

A call ends when its grammar is complete (`stop`, or `tool_calls` when the output is a tool call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hearth.inference.grammar import GrammarError, GrammarState, json_schema_grammar, lark_grammar, token_table
from hearth.protocol.chat import BadRequest, ChatRequest
from hearth.protocol.chat_tools import Tool
from hearth.services.orchestrator.catalog import LoadedModel

FINISH_TOOL_CALLS = "tool_calls"
_ANY_OBJECT = {"type": "object"}
# Text of an `auto` answer that calls no tool: anything not starting with "{" (which opens a call).
_AUTO_TEXT = r"/[^{](.|\n)*/"


@dataclass(frozen=True)
class OutputGrammar:
    """A call's grammar text, the request field it comes from (what a refusal names) and how the call ends when
    the grammar completes."""

    grammar: str
    field: str
    finish_reason: str

    def check(self, model: LoadedModel) -> None:
        """BadRequest naming the field when no output of this model's tokens can follow the grammar."""
        try:
            GrammarState(_table(model), self.grammar, []).compile()
        except GrammarError as error:
            raise BadRequest(f"field '{self.field}': hearth cannot constrain output to it: {error}",
                             param=self.field.split(".")[0]) from None

    def state(self, model: LoadedModel, generated: list[int]) -> GrammarState:
        """The call's matcher over its `generated` tokens (compiled at its first use; `check` made the token
        table already)."""
        return GrammarState(_table(model), self.grammar, generated)


def output_grammar(request: ChatRequest) -> OutputGrammar | None:
    """The grammar the request's output follows (None: free text); BadRequest naming the field it cannot make."""
    if request.tools and request.tool_choice != "none":
        return _tool_grammar(request)
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputGrammar(_schema_grammar(_ANY_OBJECT, "response_format"), "response_format", "stop")
    schema = response_format.json_schema.schema_ if response_format.json_schema else {}
    return OutputGrammar(_schema_grammar(schema, "response_format.json_schema.schema"),
                         "response_format.json_schema.schema", "stop")


def tool_call_schema(tool: Tool) -> dict:
    """The JSON schema of one call of `tool`: its name, then arguments valid against its parameters."""
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "arguments": tool.function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_grammar(request: ChatRequest) -> OutputGrammar:
    tools = request.tools or []
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    call_schema = {"anyOf": [tool_call_schema(tool) for tool in tools]} if len(tools) > 1 else tool_call_schema(
        tools[0])
    call_schema = {**call_schema, "x-guidance": {"whitespace_flexible": False}}
    if choice in (None, "auto"):
        lark = f"start: TEXT | call\nTEXT: {_AUTO_TEXT}\ncall: %json {json.dumps(call_schema)}\n"
    else:
        lark = f"start: call\ncall: %json {json.dumps(call_schema)}\n"
    try:
        grammar = lark_grammar(lark)
    except GrammarError as error:
        raise BadRequest(f"field 'tools': hearth cannot constrain a call's arguments to it: {error}",
                         param="tools") from None
    return OutputGrammar(grammar, "tools", FINISH_TOOL_CALLS)


def _schema_grammar(schema: dict, field: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarError as error:
        raise BadRequest(f"field '{field}': hearth cannot constrain output to it: {error}",
                         param=field.split(".")[0]) from None


def _table(model: LoadedModel):
    head = model.head
    stop = sorted(head.eos_token_ids)
    return token_table(head.tokenizer, head.info.vocab_size, stop[0] if stop else None)
