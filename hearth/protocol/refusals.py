"""How a message refused by its validation is described: one line naming each wrong field, a few of them at most."""

from __future__ import annotations

from pydantic import ValidationError

# The wrong fields a refusal names at most (then how many more): a body of many wrong items must not draw an answer
# many times its size.
max_described_problems = 8
# What a refusal of a request for its size says, so that a client can tell each reason from the text alone (an error
# frame has no field for it): the gateway answers each with OpenAI's status and code for it (hearth/services/gateway/
# errors.py). A prompt too long for its model's context (hearth/services/orchestrator/admission.py):
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
    client tells the reason by."""
    return f"{ARRAY_TOO_LONG}: at most {max_length} items" + (f", not {actual}" if actual else "")


def describe_validation_error(error: ValidationError) -> str:
    """One line naming the fields `error` refused, the first `max_described_problems` of them."""
    problems = []
    for item in error.errors(include_url=False)[:max_described_problems]:
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "json_invalid":
            problems.append(f"body is not valid JSON: {item['msg']}")
        elif location:
            problems.append(f"field '{location}': {_problem(item)}")
        else:
            problems.append(item["msg"])
    if error.error_count() > max_described_problems:
        problems.append(f"and {error.error_count() - max_described_problems} more")
    return "; ".join(problems)


def _problem(item: dict) -> str:
    """What is wrong with one field: a list or a string over its length in words of our own (ARRAY_TOO_LONG,
    STRING_TOO_LONG: what a client tells them by), anything else as pydantic says it."""
    context = item.get("ctx") or {}
    if item["type"] == "too_long" and context.get("field_type") == "List":
        return array_too_long(context["max_length"], context.get("actual_length"))
    if item["type"] == "string_too_long":
        return f"{STRING_TOO_LONG}: at most {context['max_length']} characters"
    return item["msg"]
