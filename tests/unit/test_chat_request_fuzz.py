"""The orchestrator's `llm.chat.request` and `llm.models` and the stream back to the client, as a hostile member writes
them (hypothesis): any request body is a ChatRequest or a BadRequest whose `error` frame is one line naming the fields
(no line break or escape sequence of the sender's) and decodes on the client as sent; any `llm.models` body is asked
or refused; and a client reads any frame an orchestrator sends as a frame, an unknown type's `seq`, or no frame. The
whole path, with a real orchestrator, is fuzzed in tests/e2e/test_bad_requests.py."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from pydantic import ValidationError

from hearth.protocol.chat import BadRequest, ChatRequest, parse_chat_request
from hearth.protocol.chat_frames import ErrorFrame, decode_frame
from hearth.protocol.discovery import ModelsRequest
from hearth.services.client.chat import _decode_known
from tests.hostile_json import hostile_body, one_showable_line

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
REQUESTS = [
    {"model": "tiny", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["x"],
     "logprobs": True, "top_logprobs": 2, "logit_bias": {"5": 1.0}, "n": 2, "params": {"verify": "none"},
     "messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "2"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], "tool_choice": "auto"},
    {"model": "tiny", "prompt": "hi", "max_tokens": 2, "presence_penalty": 1.0, "repetition_penalty": 1.1,
     "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
     "params": {"fallback_to_local": False, "quantization": "int4/g64"}},
]


@FUZZ
@given(body=hostile_body(REQUESTS, deep_field="tools"))
@example(body=b'{"prompt":"hi","response_format":{"type":"text","\\n\\u001b]0;x\\u0007":1}}')
@example(body=b'{"prompt":"hi","tools":[{"type":"function","function":{"name":"f","\\u2028":1}}]}')
def test_any_request_body_is_a_request_or_a_one_line_refusal_the_client_reads(body):
    try:
        request = parse_chat_request(body)
    except BadRequest as refused:
        frame = ErrorFrame.refusing(refused)
        assert frame.message and one_showable_line(frame.message), frame
        assert decode_frame(frame.model_dump_json().encode()) == frame
    else:
        assert isinstance(request, ChatRequest)
        assert parse_chat_request(request.model_dump_json().encode()) == request


@FUZZ
@given(body=hostile_body([{}, {"unknown": 1}], deep_field="unknown"))
def test_any_models_request_body_is_asked_or_refused(body):
    try:
        ModelsRequest.model_validate_json(body)
    except ValidationError as error:
        assert ErrorFrame.refusing(BadRequest.of_validation(error)).code == "bad_request"


FRAMES = [
    {"type": "pipeline", "seq": 0, "pipeline_id": "p", "hops": ["a", "b"], "choice": 1},
    {"type": "token_delta", "seq": 1, "text": "hi", "token_id": 5, "hops": ["a"], "choice": 1, "logprobs": {
        "text": "hi", "logprob": -0.5, "top_logprobs": [{"token_id": 1, "text": "x", "logprob": -1}]}},
    {"type": "shard_status", "seq": 2, "shard_id": "s", "status": "degraded", "reason": "r"},
    {"type": "shard_failover", "seq": 3, "failed_shard_id": "s", "replacement_hops": ["t"], "resumed_at_token": 4},
    {"type": "tokens_withdrawn", "seq": 4, "kept_tokens": 1, "shard_id": "s", "reason": "r"},
    {"type": "pipeline_aborted", "seq": 5, "code": "pipeline_stalled", "reason": "r"},
    {"type": "done", "seq": 6, "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 2},
     "timing": {"ttft_ms": 1.0, "other": 2}, "orchestrator": "o", "verification": "met",
     "choices": [{"choice": 0, "finish_reason": "stop", "completion_tokens": 1}]},
    {"type": "error", "seq": 0, "code": "overloaded", "message": "m", "retry_after_s": 3,
     "refusal": "context_exceeded", "param": "messages"},
    {"type": "keepalive", "seq": 7},
    {"type": "queued", "seq": 0, "position": 1, "queued_requests": 2},
]


@FUZZ
@given(data=hostile_body(FRAMES, deep_field="seq"))
def test_a_client_reads_any_frame_as_a_frame_a_seq_or_nothing(data):
    frame = _decode_known(data)
    if frame is not None and not isinstance(frame, int):
        frame.model_dump_json().encode("utf-8")
