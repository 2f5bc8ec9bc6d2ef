"""The structured-output options of `llm.chat.request` (docs/protocol.md): `response_format` (JSON, or JSON that
validates against a schema), `tools` and `tool_choice`, and the tool calls an assistant message of the history
carries, each bounded here so that a request's grammar stays small enough to compile at once.

A tool call's output is the JSON object ``{"name": <the function's name>, "arguments": {...}}`` whose arguments
validate against the function's `parameters` schema (hearth/services/orchestrator/constrained.py builds the grammar).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Bounds of what a request's schemas may be: their JSON size and nesting, the tools one request names.
max_schema_chars = 32_768
max_schema_depth = 32
max_tools = 64
max_tool_description_chars = 4096
max_tool_call_arguments_chars = 65_536
max_tool_calls_per_message = 64
max_tool_call_id_chars = 128
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ClosedObject(BaseModel):
    """An object of a request that refuses a key it does not declare, and only the first such key: an object of many
    is refused for one, not described key by key (a body's validation runs on its reader's event loop)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _first_undeclared_key_alone(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        declared = _declared_keys(cls)
        first = next((key for key in data if key not in declared), None)
        if first is None:
            return data
        return {key: value for key, value in data.items() if key in declared or key == first}


@functools.cache
def _declared_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys `model` reads: its fields' names and aliases."""
    return frozenset(model.model_fields) | {field.alias for field in model.model_fields.values() if field.alias}


def _depth(value: Any) -> int:
    """How deep JSON `value` nests its objects and arrays (without recursing: a client chooses the depth)."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            pending.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _bounded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    depth = _depth(schema)
    if depth > max_schema_depth:
        raise ValueError(f"the schema nests {depth} levels deep, more than {max_schema_depth}")
    try:
        size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False))
    except ValueError:  # it would travel on as null, a bound the caller never wrote
        raise ValueError("the schema holds NaN or Infinity, which JSON has no numbers for") from None
    if size > max_schema_chars:
        raise ValueError(f"the schema is {size} characters of JSON, more than {max_schema_chars}")
    return schema


# A JSON Schema (an object) within the size and depth bounds.
JsonSchema = Annotated[dict[str, Any], AfterValidator(_bounded_schema)]
ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class JsonSchemaFormat(ClosedObject):
    """`response_format.json_schema`: the schema the answer validates against (`strict` is accepted; hearth's
    answers always follow the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    name: ToolName = "response"
    description: str | None = Field(default=None, max_length=max_tool_description_chars)
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(ClosedObject):
    """`text` (the default), `json_object` (any JSON object) or `json_schema` (JSON valid against a schema)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is given exactly when 'type' is 'json_schema'")
        return self


class FunctionDefinition(ClosedObject):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    description: str | None = Field(default=None, max_length=max_tool_description_chars)
    # The schema the call's arguments validate against (absent: any JSON object).
    parameters: JsonSchema = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(ClosedObject):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(ClosedObject):
    model_config = ConfigDict(extra="forbid")

    name: ToolName


class NamedToolChoice(ClosedObject):
    """A `tool_choice` that names the one function the answer must call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionName


# `none`: text only; `auto`: text or a call; `required`: a call of any tool; a named function: a call of that one.
ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = ToolChoiceMode | NamedToolChoice


class FunctionCall(ClosedObject):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    # The arguments as JSON text (OpenAI's form); where they parse, chat templates get them as JSON, bounded as a
    # schema's nesting is.
    arguments: str = Field(default="{}", max_length=max_tool_call_arguments_chars)

    @model_validator(mode="after")
    def _arguments_nest_within_bounds(self) -> "FunctionCall":
        try:
            depth = _depth(json.loads(self.arguments))
        except ValueError:
            return self  # not JSON: templates get the text as it is
        except RecursionError:  # deeper than the parser goes
            depth = max_schema_depth + 1
        if depth > max_schema_depth:
            raise ValueError(f"the arguments nest more than {max_schema_depth} levels deep")
        return self


class ToolCall(ClosedObject):
    """A call an assistant message of the history made (`id`: what the `tool` message answering it names)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=max_tool_call_id_chars)
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object where they parse as one."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


ToolCallList = Annotated[list[ToolCall], Field(max_length=max_tool_calls_per_message)]
ToolList = Annotated[list[Tool], Field(min_length=1, max_length=max_tools)]
