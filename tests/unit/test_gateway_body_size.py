"""A request body over `[orchestrator] max_request_bytes` is answered 413 (Payload Too Large, as HTTP has it) in
OpenAI's error shape, which OpenAI's client raises as an APIStatusError carrying that status and code; a body
within the limit is served."""

from __future__ import annotations

import openai
import pytest

from hearth.services.common.config import HearthSettings
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, done, gateway, token  # noqa: F401 (gateway is a fixture)

limit = 1024


@pytest.fixture
def small_limit(gateway):
    http, scripted = gateway
    scripted.settings = HearthSettings(orchestrator={"max_request_bytes": limit})
    return http, scripted


async def test_a_body_over_the_limit_is_413_in_openai_s_error_shape(small_limit):
    http, scripted = small_limit
    with pytest.raises(openai.APIStatusError) as refused:
        await openai_client(http).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * limit}])
    assert refused.value.status_code == 413
    assert (refused.value.code, refused.value.type) == ("request_too_large", "invalid_request_error")
    assert f"over {limit} bytes" in refused.value.message
    assert not scripted.received


async def test_a_body_within_the_limit_is_served(small_limit):
    http, scripted = small_limit
    scripted.scripts.append([token(0, "ok"), done(1, 1)])
    answer = await openai_client(http).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * (limit // 2)}])
    assert answer.choices[0].message.content == "ok"
