"""How a refused request is described: one line naming each wrong field (a few of them at most), and for a program
the field it names first and, where a client acts on it, why (RefusalReason)."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationError

from hearth.protocol.display_text import display_text

# The wrong fields a refusal names at most (then how many more): a body of many wrong items must not draw an answer
# many times its size.
max_described_problems = 8
# Why a request was refused, where a client acts on the reason (trims a conversation, never sends the body again):
# an `error` frame's `refusal` (hearth/protocol/chat_frames.py), which the gateway answers with OpenAI's status and
# code for it (hearth/services/gateway/errors.py). `unknown_model`: the request names a model the orchestrator does
# not serve; the others are the sizes below.
RefusalReason = Literal["request_too_large", "context_exceeded", "array_too_long", "string_too_long", "unknown_model"]
# The longest `param` (the field a refusal names, at its top level) an error frame carries.
max_param_chars = 256
# What a refusal for each size says: the words a gateway tells the reason by in a frame with no `refusal` (between
# an orchestrator and a gateway of which one is older than the field). A prompt too long for its model's context
# (hearth/services/orchestrator/admission.py):
CONTEXT_EXCEEDED = "exceed the model's context"
# A body over the orchestrator's max_request_bytes (body_too_large):
OVER_MAX_REQUEST_BYTES = "is over max_request_bytes"
# A list (`messages`, `stop`, ...) or a string longer than its bound allows (describe_validation_error):
ARRAY_TOO_LONG = "array too long"
STRING_TOO_LONG = "string too long"


def body_too_large(size: int, limit: int) -> str:
    """The refusal of a request body of `size` bytes, over the orchestrator's max_request_bytes `limit`."""
    return f"body: {size} bytes {OVER_MAX_REQUEST_BYTES} {limit}"


def array_too_long(max_length: int, actual: int | None = None) -> str:
    """What is wrong with a list of `actual` items over its bound of `max_length`, in the words (ARRAY_TOO_LONG) a
    frame without `refusal` is told by."""
    return f"{ARRAY_TOO_LONG}: at most {max_length} items" + (f", not {actual}" if actual else "")


class FieldsDisagree(ValueError):
    """A rule between a request's fields that it breaks (raised in a model validator, whose problem has no field
    of its own): `param` is the field a refusal names, OpenAI's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _disagreement(item: dict) -> FieldsDisagree | None:
    error = (item.get("ctx") or {}).get("error")
    return error if isinstance(error, FieldsDisagree) else None


def describe_validation_error(error: ValidationError) -> str:
    """One line naming the fields `error` refused, the first `max_described_problems` of them; what of it the sender
    wrote (an unknown key, a tag) shown as display_text shows it, so no line break or escape sequence of theirs
    makes it two lines or disguises it."""
    problems = []
    for item in error.errors(include_url=False)[:max_described_problems]:
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "json_invalid":
            problems.append(f"body is not valid JSON: {item['msg']}")
        elif location:
            problems.append(f"field '{location}': {_problem(item)}")
        elif (disagreement := _disagreement(item)) is not None:
            problems.append(str(disagreement))  # in its own words, without pydantic's "Value error, "
        else:
            problems.append(item["msg"])
    if error.error_count() > max_described_problems:
        problems.append(f"and {error.error_count() - max_described_problems} more")
    return display_text("; ".join(problems))


def refused_field(error: ValidationError) -> str | None:
    """The field `error` refused first, by its top-level name (OpenAI's `param`); None when no problem names one, or
    when the name is none a frame can carry (an unknown key of the client's, empty or over max_param_chars)."""
    names = [str(item["loc"][0]) if item["loc"] else disagreement.param
             for item in error.errors(include_url=False)
             if item["loc"] or (disagreement := _disagreement(item)) is not None]
    name = names[0] if names else ""
    return name if 0 < len(name) <= max_param_chars else None


def validation_reason(error: ValidationError) -> RefusalReason | None:
    """Why `error` refused the request, as its first problem (the one describe_validation_error names first) says:
    a list or a string over its bound, else None."""
    problems = error.errors(include_url=False)
    return _reason(problems[0]) if problems else None


def _reason(item: dict) -> RefusalReason | None:
    context = item.get("ctx") or {}
    if item["type"] == "too_long" and context.get("field_type") == "List":
        return "array_too_long"
    if item["type"] == "string_too_long":
        return "string_too_long"
    return None


def _problem(item: dict) -> str:
    """What is wrong with one field: a list or a string over its length in words of our own (ARRAY_TOO_LONG,
    STRING_TOO_LONG: what a frame without `refusal` is told by), anything else as pydantic says it."""
    context = item.get("ctx") or {}
    reason = _reason(item)
    if reason == "array_too_long":
        return array_too_long(context["max_length"], context.get("actual_length"))
    if reason == "string_too_long":
        return f"{STRING_TOO_LONG}: at most {context['max_length']} characters"
    return item["msg"]
