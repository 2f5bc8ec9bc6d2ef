"""The gateway's mappings without a network: OpenAI request bodies onto `llm.chat.request`, refusals of what hearth
cannot honour, error frames onto HTTP statuses, answers onto OpenAI objects, and API keys onto members."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hearth.protocol.chat import BadRequest
from hearth.protocol.bounds import max_retry_after_s
from hearth.protocol.chat_frames import DoneFrame, ErrorFrame, PipelineAbortedFrame, Usage, decode_frame
from hearth.services.gateway.answers import ChatShape, CompletionShape, finish_reason
from hearth.services.gateway.errors import from_frame
from hearth.services.gateway.keys import (
    API_KEYS_FILE,
    ApiKeyError,
    ApiKeyring,
    WatchedApiKeyring,
    bearer_token,
    create_api_key,
    revoke_api_keys,
)
from hearth.services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, Unsupported
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey
from tests.unit.test_gateway_retry_hints import waits_as_named


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_a_chat_body_maps_onto_a_chat_request():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
                   max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.9, seed=3, stop="END",
                   user="someone", metadata={"x": "y"}).to_chat_request()
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "ab")]
    assert (request.max_tokens, request.temperature, request.top_p, request.seed, request.stop) == (
        7, 0.0, 0.9, 3, ["END"])


def test_openai_sampling_defaults_and_max_tokens_left_to_the_context():
    request = chat().to_chat_request()
    # Left out, it stays out: the orchestrator gives the answer up to 128 tokens, fewer where the context ends.
    assert (request.temperature, request.top_p, request.max_tokens, request.model) == (1.0, 1.0, None, "m")
    assert request.most_tokens == 128 and "max_tokens" not in request.model_dump(exclude_none=True)
    completion = CompletionRequest.model_validate({"prompt": ["raw text"], "max_tokens": 3}).to_chat_request()
    assert (completion.prompt, completion.messages, completion.model, completion.max_tokens) == (
        "raw text", None, None, 3)


@pytest.mark.parametrize("fields, param", [
    ({"n": 9}, "n"),
    ({"functions": [{"name": "lookup"}]}, "functions"),
    ({"function_call": "auto"}, "functions"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_what_hearth_cannot_honour_is_refused_by_name(fields, param):
    with pytest.raises(Unsupported) as refused:
        chat(**fields).to_chat_request()
    assert refused.value.param == param


def test_n_maps_onto_the_request_s_choices():
    assert (chat().to_chat_request().n, chat(n=1).to_chat_request().n, chat(n=8).to_chat_request().n) == (1, 1, 8)
    assert CompletionRequest.model_validate({"prompt": "x", "n": 3}).to_chat_request().n == 3
    with pytest.raises(Unsupported, match="at most 8") as refused:
        CompletionRequest.model_validate({"prompt": "x", "n": 9}).to_chat_request()
    assert refused.value.param == "n"


def test_response_format_tools_and_a_tool_history_go_onto_the_request():
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    request = chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
                   ).to_chat_request()
    assert request.response_format.json_schema.schema_ == {"type": "object"}
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": history, "tools": [lookup],
                                                    "tool_choice": "required"}).to_chat_request()
    assert request.tool_choice == "required" and request.tools[0].function.name == "lookup"
    assert [m.role for m in request.messages] == ["user", "assistant", "tool"]
    assert request.messages[1].tool_calls[0].function.name == "lookup" and request.messages[1].content == ""


def nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"a": schema}
    return schema


@pytest.mark.parametrize("fields, named", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": nested(40)}}},
     "response_format.json_schema.schema"),
    # NaN would travel on as null, a bound the caller never wrote.
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "number",
                                                                            "maximum": float("nan")}}}},
     "response_format.json_schema.schema': Value error, the schema holds NaN or Infinity"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"minimum": float("-inf")}}}]},
     "tools.0.function.parameters': Value error, the schema holds NaN or Infinity"),
])
def test_structured_options_hearth_cannot_take_are_bad_requests_naming_the_field(fields, named):
    """Refused as the gateway refuses a body: by its validation, or when mapped."""
    try:
        chat(**fields).to_chat_request()
    except ValidationError as error:
        refused = BadRequest.of_validation(error)
    except BadRequest as error:
        refused = error
    else:
        raise AssertionError(f"{fields} was taken")
    assert named in str(refused), str(refused)


def test_values_hearth_refuses_are_bad_requests():
    with pytest.raises(BadRequest, match="stop"):
        chat(stop="").to_chat_request()
    with pytest.raises(ValidationError, match="max_tokens"):  # bounded in the body itself
        chat(max_tokens=10**6)
    with pytest.raises(Unsupported):
        CompletionRequest.model_validate({"prompt": ["a", "b"]}).to_chat_request()


@pytest.mark.parametrize("code, status", [
    ("bad_request", 400), ("unauthorized", 403), ("overloaded", 429), ("shard_unavailable", 503),
    ("pipeline_stalled", 503), ("orchestrator_gone", 503), ("internal_error", 500), ("weights_mismatch", 500),
    ("experimental_disabled", 500),
])
def test_error_frames_map_onto_statuses(code, status):
    error = from_frame(ErrorFrame(seq=0, code=code, message="m"))
    assert (error.status, error.code) == (status, code)
    assert from_frame(PipelineAbortedFrame(seq=3, code=code, reason="r")).status == status


def test_an_unknown_model_is_404_and_overloaded_names_its_wait():
    unknown = from_frame(ErrorFrame(seq=0, code="bad_request", message="field 'model': no model 'x'"))
    assert (unknown.status, unknown.code, unknown.param) == (404, "model_not_found", "model")
    said = ErrorFrame(seq=0, code="bad_request", message="no model 'x'", refusal="unknown_model", param="model")
    assert (from_frame(said).status, from_frame(said).code) == (404, "model_not_found")
    # A model left out where the mesh serves several names the field and no reason: not an unknown model.
    left_out = ErrorFrame(seq=0, code="bad_request", message="field 'model': required when ...", param="model")
    assert (from_frame(left_out).status, from_frame(left_out).code, from_frame(left_out).param) == (
        400, "bad_request", "model")

    class QueuedOut(ErrorFrame):  # an orchestrator with an admission queue says how long to wait
        retry_after_s: float

    response = from_frame(QueuedOut(seq=0, code="overloaded", message="full", retry_after_s=2.5)).response()
    assert response.status_code == 429 and waits_as_named(response.headers, 2.5)
    assert waits_as_named(from_frame(ErrorFrame(seq=0, code="overloaded", message="full"), 7).response().headers, 7)
    assert json.loads(response.body)["error"] == {"message": "full", "type": "rate_limit_error", "param": None,
                                                  "code": "overloaded"}



@pytest.mark.parametrize("named", ["1e308", '"Infinity"', "86400"])
def test_a_frame_naming_a_wait_past_an_hour_asks_an_hour(named):
    """An orchestrator (a member, or a bug) naming an endless wait must not break the gateway's answer: the frame
    still counts, and its Retry-After is the longest wait hearth suggests."""
    frame = decode_frame(f'{{"type": "error", "seq": 0, "code": "overloaded", "message": "full", '
                         f'"retry_after_s": {named}}}'.encode())
    assert frame.retry_after_s == max_retry_after_s
    response = from_frame(frame).response()
    assert (response.status_code, response.headers["retry-after"]) == (429, str(int(max_retry_after_s)))
    assert response.headers["retry-after-ms"] == str(int(max_retry_after_s * 1000))
    # A negative wait reads as none (docs/protocol.md, "Reading a frame"): [gateway] retry_after_s.
    negative = decode_frame(b'{"type": "error", "seq": 0, "code": "overloaded", "message": "full", '
                            b'"retry_after_s": -1}')
    assert negative.retry_after_s == 0.0 and waits_as_named(from_frame(negative).response().headers, 1)

def test_answers_have_openai_s_shape():
    done = DoneFrame(seq=4, finish_reason="fallback_length", usage=Usage(prompt_tokens=5, completion_tokens=2))
    assert finish_reason(done) == "length"
    assert finish_reason(done.model_copy(update={"finish_reason": "stop"})) == "stop"
    whole = ChatShape(id="chatcmpl-1", model="m").whole("hi", done).model_dump()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    chunk = json.loads(ChatShape(id="c", model="m").text("x").model_dump_json())
    assert chunk["choices"][0]["delta"] == {"content": "x"} and "usage" not in chunk
    assert CompletionShape(id="cmpl-1", model="m").ending(done).choices[0].finish_reason == "length"


@pytest.fixture
def community(tmp_path) -> Community:
    folder = Community.init(tmp_path / "community", "test")
    folder.add("alice", "client")
    folder.add("bob", "client", public_key=MemberKey.generate().public_key)
    return folder


def test_api_keys_map_to_members_and_only_their_hashes_are_kept(community):
    first, second = create_api_key(community.directory, "alice"), create_api_key(community.directory, "alice")
    keys_file = community.directory / API_KEYS_FILE
    assert first != second and first not in keys_file.read_text() and keys_file.stat().st_mode & 0o777 == 0o600
    keyring = ApiKeyring.load(community.directory)
    assert keyring.caller_for(first).name == keyring.caller_for(second).name == "alice"
    assert keyring.caller_for(first).key.public_key == community.roster().by_name("alice").public_key
    assert keyring.caller_for(first + "x") is None and keyring.caller_for("") is None
    assert revoke_api_keys(community.directory, "alice") == 2
    assert ApiKeyring.load(community.directory).caller_for(first) is None


def test_a_key_for_a_member_whose_key_is_not_here_is_refused(community):
    with pytest.raises(ApiKeyError, match="bob's key"):
        create_api_key(community.directory, "bob")  # bob brought his own key: the gateway cannot sign for him
    with pytest.raises(ApiKeyError, match="not a member"):
        create_api_key(community.directory, "mallory")
    with pytest.raises(ApiKeyError, match="does not exist"):
        ApiKeyring.load(community.directory)


def test_no_key_is_made_or_used_for_a_member_whose_role_may_not_call(community, caplog):
    """The gateway signs with the member's own key: a key for a shard host or an orchestrator would put that
    member's seed (which signs its events) in an HTTP-facing process, for calls orchestrators refuse."""
    community.add("kitchen-pc", "shard")
    with pytest.raises(ApiKeyError, match="kitchen-pc is a shard"):
        create_api_key(community.directory, "kitchen-pc")
    # One written before this rule (or by hand): refused at start, left out of a keyring read again.
    create_api_key(community.directory, "alice")
    keys_file = community.directory / API_KEYS_FILE
    document = json.loads(keys_file.read_text())
    document["keys"].append({**document["keys"][0], "name": "kitchen-pc", "sha256": "0" * 64})
    keys_file.write_text(json.dumps(document))
    with pytest.raises(ApiKeyError, match="kitchen-pc is a shard"):
        ApiKeyring.load(community.directory)
    assert ApiKeyring.load(community.directory, skip_unusable=True).members == ["alice"]
    assert create_api_key(community.directory, "system")  # the steward's own key may call


def test_bearer_tokens():
    assert bearer_token("Bearer abc") == bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None) is bearer_token("Basic abc") is bearer_token("Bearer ") is None


class SteppedClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_running_gateway_sees_keys_made_and_revoked_within_the_recheck(community, caplog):
    first = create_api_key(community.directory, "alice")
    clock = SteppedClock()
    keyring = WatchedApiKeyring(community.directory, recheck_s=1.0, clock=clock)
    second = create_api_key(community.directory, "alice")
    assert keyring.caller_for(second) is None  # not looked at again before the recheck interval
    clock.now_s = 1.0
    assert keyring.caller_for(second).name == "alice" and keyring.caller_for(first).name == "alice"
    revoke_api_keys(community.directory, "alice")
    clock.now_s = 2.0
    assert keyring.caller_for(first) is None and keyring.caller_for(second) is None and len(keyring) == 0

    third = create_api_key(community.directory, "alice")
    (community.directory / API_KEYS_FILE).write_text("{ not json")  # a broken edit keeps the last good keys
    clock.now_s = 3.0
    assert keyring.caller_for(third) is None and len(keyring) == 0
    assert "last good ones stay in use" in caplog.text
    # A deleted file revokes every key, rather than leaving the last ones in use.
    (community.directory / API_KEYS_FILE).unlink()
    fourth = create_api_key(community.directory, "alice")
    clock.now_s = 4.0
    assert keyring.caller_for(fourth).name == "alice"
    (community.directory / API_KEYS_FILE).unlink()
    clock.now_s = 5.0
    assert keyring.caller_for(fourth) is None and len(keyring) == 0



def test_a_member_removed_from_the_roster_does_not_freeze_the_other_keys(community, caplog):
    """Before, one key of a member no longer in the roster failed the whole keyring read again, and the gateway kept
    the last good keys for good: a revocation of anyone else's keys never took effect."""
    community.add("carol", "client")
    alice, carol = create_api_key(community.directory, "alice"), create_api_key(community.directory, "carol")
    clock = SteppedClock()
    keyring = WatchedApiKeyring(community.directory, recheck_s=1.0, clock=clock)
    assert keyring.caller_for(carol).name == "carol"
    roster_file = community.directory / "roster.json"
    roster = json.loads(roster_file.read_text())
    roster["members"] = [member for member in roster["members"] if member["name"] != "carol"]
    roster_file.write_text(json.dumps(roster))
    revoke_api_keys(community.directory, "alice")
    clock.now_s = 1.0
    assert keyring.caller_for(alice) is None and keyring.caller_for(carol) is None
    assert "API keys of carol left out" in caplog.text


def test_a_body_may_ask_for_a_quantization_scheme():
    assert chat(hearth={"quantization": "int4/g64"}).to_chat_request().params.quantization == "int4/g64"
    assert chat().to_chat_request().params.quantization is None
    with pytest.raises(Unsupported) as refused:
        chat(hearth={"quantization": "int3"}).to_chat_request()
    assert str(refused.value) == ("field 'hearth.quantization': 'int3' names no scheme: expected none, int8, int4 or "
                                  "int4/gN (N: a group size)")
