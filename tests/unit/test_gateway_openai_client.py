"""The gateway as OpenAI's official Python client meets it, over scripted frame streams without a network: what the
client reads from an answer or an error (`code`, `type`, `param`, the request id) is what OpenAI's API gives."""

from __future__ import annotations

import openai
import pytest

from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import gateway, MODEL  # noqa: F401 (gateway is a fixture)

HI = [{"role": "user", "content": "hi"}]
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [LOOKUP], "response_format": {"type": "json_object"}}, "response_format"),
])
async def test_fields_that_disagree_are_refused_naming_the_field_in_plain_words(gateway, fields, param):
    """A rule between fields used to be refused with `param` null and pydantic's "Value error, " before its words."""
    http, scripted = gateway
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(http).chat.completions.create(model=MODEL, messages=HI, **fields)
    assert (refused.value.code, refused.value.param) == ("bad_request", param), refused.value.body
    assert "Value error" not in refused.value.message and f"'{param}'" in refused.value.message, refused.value.message
    assert not scripted.received
