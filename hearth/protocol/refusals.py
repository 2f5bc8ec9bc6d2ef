"""How a message refused by its validation is described: one line naming each wrong field, a few of them at most."""

from __future__ import annotations

from pydantic import ValidationError

# The wrong fields a refusal names at most (then how many more): a body of many wrong items must not draw an answer
# many times its size.
max_described_problems = 8
# What the refusal of a prompt too long for its model's context says (hearth/services/orchestrator/admission.py): the
# gateway answers it with OpenAI's code for it, `context_length_exceeded`.
CONTEXT_EXCEEDED = "exceed the model's context"


def describe_validation_error(error: ValidationError) -> str:
    """One line naming the fields `error` refused, the first `max_described_problems` of them."""
    problems = []
    for item in error.errors(include_url=False)[:max_described_problems]:
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "json_invalid":
            problems.append(f"body is not valid JSON: {item['msg']}")
        elif location:
            problems.append(f"field '{location}': {item['msg']}")
        else:
            problems.append(item["msg"])
    if error.error_count() > max_described_problems:
        problems.append(f"and {error.error_count() - max_described_problems} more")
    return "; ".join(problems)
