"""The OpenAI-compatible gateway in front of a real community mesh (nats-server, three shard hosts, an orchestrator,
`hearth gateway`): the official `openai` client (sync and async, streamed and not) gets exactly what `hearth chat`
gets for the same greedy request, `curl -N` sees the stream token by token, every error status comes from a real
cause, and a client that disconnects has its call ended and the shards' sessions freed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from hearth.events.streams import PIPELINES_STREAM
from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.broker.connection import connect_nats
from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from tests.e2e.failover_support import (
    ShardHandle,
    pipeline_events,
    read_events,
    wait_for_event,
    wait_until_released,
)
from tests.unit.inference_tiny_models import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = "the quick brown fox"
MAX_TOKENS = 12
PARTIAL_MODEL = "tiny-partial"
FAILOVER_TOKENS = 24
HTTP_WAIT_S = 60


class Mesh:
    """The module's mesh, its gateway and the API keys made for it."""

    def __init__(self, cluster: LocalCluster, gateway_url: str, keys: dict[str, str],
                 metrics_url: str | None = None) -> None:
        self.cluster = cluster
        self.url = gateway_url
        self.keys = keys
        self.metrics_url = metrics_url

    def client(self, member: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[member], max_retries=0)

    def async_client(self, member: str = "alice") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[member], max_retries=0)

    def shards(self) -> list[ShardHandle]:
        return [ShardHandle(process, process.ready_file.read_text().strip().rpartition("@")[2], 0, 0)
                for process in self.cluster.processes if process.name.startswith("shard-") and process.alive]

    def hearth_chat(self, *args: str, max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
        """`hearth chat --json`: the text and the `done` frame of the same request (its token texts: `.pieces`)."""
        completed = subprocess.run(
            [sys.executable, "-m", "hearth.services.cli", "chat", *args, "--json", "--max-tokens", str(max_tokens),
             "--model", TINY_MODEL_NAME], capture_output=True, text=True, timeout=HTTP_WAIT_S,
            env={**os.environ, **self.cluster.client_env("chat-user"), "HEARTH_NATS_URL": self.cluster.nats_url})
        assert completed.returncode == 0, completed.stderr
        frames = [json.loads(line) for line in completed.stdout.splitlines()]
        self.pieces = [f["text"] for f in frames if f["type"] == "token_delta"]
        return "".join(self.pieces), frames[-1]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir):
    # A second model the orchestrator knows, served only in part (layers 0-1 of 6): calls for it are 503.
    partial_dir = tmp_path_factory.mktemp("partial-models")
    write_tiny_model(partial_dir / PARTIAL_MODEL, "llama")
    work_dir = tmp_path_factory.mktemp("gateway")
    with three_shard_mesh(work_dir, tiny_models_dir, orchestrator_args=["--models-dir", str(partial_dir)]) as cluster:
        cluster.start_shard(str(partial_dir / PARTIAL_MODEL), 0, 1, node_id="partial-host", wait_ready=False)
        # A second host for layers 2-3: a call whose host for them dies fails over to it.
        cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), 2, 3, node_id="spare-host", wait_ready=False)
        cluster.wait_all_ready()
        keys = {name: create_api_key(cluster.member_key(name, "client").parents[1], name)
                for name in ("alice", "dora", "frank")}
        gateway = cluster.start_gateway()
        yield Mesh(cluster, gateway.ready_file.read_text(), keys, gateway.metrics_url)


def test_the_openai_client_gets_what_hearth_chat_gets(mesh):
    expected_text, done = mesh.hearth_chat(PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    answer = mesh.client().chat.completions.create(model=TINY_MODEL_NAME, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.content == expected_text
    assert answer.choices[0].finish_reason == done["finish_reason"] == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"])
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens

    chunks = list(mesh.client().chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, temperature=0, max_completion_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done["usage"]["completion_tokens"]


async def test_the_async_client_streams_and_completes_raw_prompts(mesh):
    expected_text, done = mesh.hearth_chat(PROMPT, "--raw")
    client = mesh.async_client()
    try:
        answer = await client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, temperature=0,
                                                 max_tokens=MAX_TOKENS)
        assert answer.choices[0].text == expected_text
        assert answer.usage.completion_tokens == done["usage"]["completion_tokens"]
        stream = await client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert "".join(pieces) == expected_text
        chat_text, _ = await asyncio.to_thread(mesh.hearth_chat, PROMPT)
        chat = await client.chat.completions.create(model=TINY_MODEL_NAME, temperature=0, max_tokens=MAX_TOKENS,
                                                    messages=[{"role": "user", "content": PROMPT}], stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in chat if c.choices]) == chat_text
        models = await client.models.list()
        assert [model.id for model in models.data] == [TINY_MODEL_NAME]
    finally:
        await client.close()


def curl_stream(mesh: Mesh, body: dict) -> subprocess.Popen:
    return subprocess.Popen(
        ["curl", "-sS", "-N", f"{mesh.url}/v1/chat/completions", "-H", "Content-Type: application/json",
         "-H", f"Authorization: Bearer {mesh.keys['dora']}", "-d", json.dumps(body)],
        stdout=subprocess.PIPE, text=True)


def test_curl_sees_the_stream_token_by_token(mesh):
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True}
    curl = curl_stream(mesh, body)
    events = [line.removeprefix("data: ").rstrip("\n") for line in curl.stdout if line.startswith("data: ")]
    assert curl.wait(timeout=HTTP_WAIT_S) == 0
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    expected_text, done = mesh.hearth_chat(PROMPT)
    # One event per token (a token whose text is held back, an incomplete UTF-8 sequence, has none): the opening
    # one (role), then each token's text as `hearth chat` received it, then the finish reason.
    assert texts[0] == "" and texts[-1] is None and "".join(texts[1:-1]) == expected_text
    assert texts[1:-1] == [piece for piece in mesh.pieces if piece]
    assert len(mesh.pieces) == done["usage"]["completion_tokens"]


def http(mesh: Mesh, path: str, body: dict | None = None, api_key: str | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one plain HTTP call."""
    request = urllib.request.Request(f"{mesh.url}{path}", data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_WAIT_S) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def chat_body(**changes) -> dict:
    return {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **changes}


@pytest.mark.parametrize("changes, status, code, says", [
    ({"n": 9}, 400, "bad_request", "'n' must be at most 8"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, 400, "bad_request", "tools"),
    ({"temperature": 3}, 400, "bad_request", "temperature"),
    ({"model": "no-such-model"}, 404, "model_not_found", "no-such-model"),
    ({"model": PARTIAL_MODEL}, 503, "shard_unavailable", "layers 2-5"),
    ({"max_tokens": 4096}, 400, "context_length_exceeded", "leaves no room for a prompt"),
    ({"messages": [{"role": "user", "content": PROMPT * 200}]}, 400, "context_length_exceeded", "exceed the model"),
], ids=["n", "tools", "temperature", "unknown-model", "partial-model", "max-tokens-over-context",
        "prompt-over-context"])
def test_each_error_has_its_status(mesh, changes, status, code, says):
    got, _, body = http(mesh, "/v1/chat/completions", chat_body(**changes), mesh.keys["alice"])
    assert (got, body["error"]["code"]) == (status, code), body
    assert says in body["error"]["message"]


def test_a_body_the_orchestrator_refuses_for_its_size_is_413_as_the_gateway_s_own_refusal(mesh):
    """A gateway whose [orchestrator] max_request_bytes is above the orchestrator's passes a body the orchestrator
    refuses for its size: the client gets 413 `request_too_large`, as when the gateway refuses it, not a 400."""
    lenient = mesh.cluster.start_gateway(name="lenient-gateway",
                                         env={"HEARTH_ORCHESTRATOR__MAX_REQUEST_BYTES": str(4 * 1024 * 1024)})
    lenient_mesh = Mesh(mesh.cluster, lenient.ready_file.read_text(), mesh.keys)
    big = chat_body(messages=[{"role": "user", "content": "x" * 700_000}, {"role": "user", "content": "y" * 700_000}])
    status, _, body = http(lenient_mesh, "/v1/chat/completions", big, mesh.keys["alice"])
    assert (status, body["error"]["code"]) == (413, "request_too_large"), body
    assert "max_request_bytes 1048576" in body["error"]["message"]


def test_calls_without_a_known_api_key_are_401(mesh):
    for api_key in (None, "hearth-not-a-key"):
        status, headers, body = http(mesh, "/v1/chat/completions", chat_body(), api_key)
        assert (status, body["error"]["type"]) == (401, "authentication_error")
        assert headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="hearth-wrong", max_retries=0).models.list()


def test_a_gateway_at_its_limit_answers_429_with_retry_after(mesh):
    small = mesh.cluster.start_gateway(name="small-gateway", env={"HEARTH_GATEWAY__MAX_OPEN_REQUESTS": "1"})
    small_mesh = Mesh(mesh.cluster, small.ready_file.read_text(), mesh.keys)
    # Greedy and long, so that the open call cannot end (end-of-text, or its last token) before the second arrives.
    stream = small_mesh.client().chat.completions.create(**chat_body(max_tokens=500, temperature=0), stream=True)
    try:
        next(iter(stream))  # the one open call
        status, headers, body = http(small_mesh, "/v1/chat/completions", chat_body(), mesh.keys["alice"])
        assert (status, body["error"]["code"]) == (429, "overloaded")
        # When the open call is likely to end, spread; in milliseconds too, which OpenAI's clients read first.
        assert int(headers["retry-after-ms"]) >= 500 and int(headers["retry-after"]) >= 1
    finally:
        stream.close()


async def test_a_client_that_disconnects_frees_the_shards_and_the_caller_is_recorded(mesh):
    # Greedy: a sampled answer of the random tiny model may draw its end-of-text token within a few tokens and
    # complete before the disconnect is noticed (seen once in CI); the greedy one runs all 500 (its end-of-text
    # would come at token 682).
    nc = await connect_nats(mesh.cluster.nats_url, name="gateway-test", settings=mesh.cluster.nats_settings())
    try:
        earlier = {stored.event.pipeline_id for stored in await read_events(nc, PIPELINES_STREAM,
                                                                           ["hearth.events.pipeline.>"])}
        curl = curl_stream(mesh, chat_body(max_tokens=500, stream=True, temperature=0))
        tokens = 0
        for line in curl.stdout:
            tokens += line.startswith("data: ")
            if tokens == 4:
                break
        curl.kill()
        curl.wait()
        stats = await wait_until_released(nc, mesh.shards())
        assert all(s.active_streams == 0 and s.cached_sessions == 0 for s in stats.values()), stats
        # This call's own pipeline: audit events are stored after the call's frames (hearth/events/outbox.py), so an
        # earlier call of dora's may still be the newest one stored.
        constructed = await wait_for_event(nc, PIPELINES_STREAM, lambda stored: (
            stored.event.type == "pipeline.constructed" and stored.event.caller == "dora"
            and stored.event.pipeline_id not in earlier))
        events = await pipeline_events(nc, constructed.event.pipeline_id)
        assert (events[-1].event.type, events[-1].event.code) == ("pipeline.aborted", "client_gone")
        assert all(PROMPT not in json.dumps(stored.event.model_dump(mode="json")) for stored in events)
    finally:
        await nc.close()


def test_an_answer_cut_inside_a_character_ends_before_it_streamed_or_not(mesh, tiny_models_dir):
    """max_tokens 1 and a token that is the first byte of a three-byte character (logit_bias all but forces it):
    the answer's text is empty, not U+FFFD, streamed or not, and it still ends `length` with that token counted."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / TINY_MODEL_NAME)
    first_byte = tokenizer("東", add_special_tokens=False)["input_ids"][0]
    assert tokenizer.decode([first_byte]) == "\ufffd"
    request = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
               "logit_bias": {str(first_byte): 100}}
    answer = mesh.client().chat.completions.create(**request)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("", "length")
    assert answer.usage.completion_tokens == 1
    completion = mesh.client().completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                                  logit_bias={str(first_byte): 100})
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("", "length")
    chunks = [chunk for chunk in mesh.client().chat.completions.create(**request, stream=True) if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_health_and_metrics(mesh):
    status, _, body = http(mesh, "/healthz")
    assert status == 200 and body["nats_connected"] is True
    assert http(mesh, "/v1/completions", {"model": "nowhere", "prompt": "x"}, mesh.keys["alice"])[0] == 404
    assert http(mesh, "/v1/models", api_key=mesh.keys["alice"])[0] == 200
    # /metrics has a port of its own (--metrics-port, on 127.0.0.1 by default), not the API's.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{mesh.url}/metrics", timeout=HTTP_WAIT_S)
    assert refused.value.code == 404
    with urllib.request.urlopen(mesh.metrics_url, timeout=HTTP_WAIT_S) as response:
        text = response.read().decode()
    assert 'hearth_gateway_requests_total{route="/v1/models",status="200"}' in text
    assert 'hearth_gateway_request_seconds_count{route="/v1/completions",status="404"}' in text


async def test_a_failover_is_a_pause_in_the_stream_not_a_break(mesh):
    """SIGKILL the host running layers 2-3 of a streamed call after its third token: the stream goes on over the
    other host and ends as the uninterrupted greedy answer does. Last of the module's mesh tests: it kills a host."""
    expected_text, done = await asyncio.to_thread(mesh.hearth_chat, PROMPT, max_tokens=FAILOVER_TOKENS)
    client = mesh.async_client("frank")
    nc = await connect_nats(mesh.cluster.nats_url, name="gateway-failover", settings=mesh.cluster.nats_settings())
    try:
        stream = await client.chat.completions.create(model=TINY_MODEL_NAME, temperature=0, stream=True,
                                                      max_tokens=FAILOVER_TOKENS, messages=[{"role": "user",
                                                                                            "content": PROMPT}])
        pieces, reasons = [], []
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
            if len(pieces) == 4:  # the opening chunk and three tokens
                constructed = await wait_for_event(nc, PIPELINES_STREAM, lambda stored: (
                    stored.event.type == "pipeline.constructed" and stored.event.caller == "frank"))
                victim = next(hop for hop in constructed.event.hops if ":2-3@" in hop)
                next(p for p in mesh.cluster.processes
                     if p.ready_file and p.ready_file.read_text().strip() == victim).signal(signal.SIGKILL)
        events = await pipeline_events(nc, constructed.event.pipeline_id)
    finally:
        await client.close()
        await nc.close()
    assert "".join(pieces) == expected_text and reasons[-1] == done["finish_reason"] == "length"
    assert [stored.event.type for stored in events].count("pipeline.failover") == 1


def test_an_open_mesh_needs_no_key_and_says_503_then_500(tmp_path):
    """No orchestrator: 503 `orchestrator_gone`; an orchestrator with distributed inference switched off: 500."""
    with LocalCluster(work_dir=tmp_path / "open", torch_threads=1, secure=False) as cluster:
        cluster.start_nats()
        url = cluster.start_gateway().ready_file.read_text()
        bare = Mesh(cluster, url, {})
        status, _, body = http(bare, "/v1/chat/completions", chat_body())
        assert (status, body["error"]["code"]) == (503, "orchestrator_gone")
        status, _, body = http(bare, "/v1/models")
        assert (status, body["error"]["code"]) == (503, "orchestrator_gone")
        cluster.extra_env["HEARTH_RESEARCH__ENABLE"] = "false"
        cluster.start_orchestrator()
        status, _, body = http(bare, "/v1/chat/completions", chat_body(model=None))
        assert (status, body["error"]["code"], body["error"]["type"]) == (500, "experimental_disabled", "server_error")


def test_hearth_community_api_key_prints_a_key_once_and_keeps_its_hash(tmp_path):
    hearth = [sys.executable, "-m", "hearth.services.cli", "community"]
    folder = tmp_path / "community"
    subprocess.run([*hearth, "init", "--name", "t", "--dir", str(folder)], check=True, capture_output=True)
    subprocess.run([*hearth, "add", "--name", "erin", "--role", "client", "--offline", "--dir", str(folder)],
                   check=True, capture_output=True)
    made = subprocess.run([*hearth, "api-key", "--name", "erin", "--dir", str(folder)], capture_output=True,
                          text=True, check=True)
    api_key = made.stdout.strip()
    stored = (folder / "api_keys.json").read_text()
    assert api_key.startswith("hearth-") and api_key not in stored and "erin" in stored
    assert Path(folder / "api_keys.json").stat().st_mode & 0o777 == 0o600
    refused = subprocess.run([*hearth, "api-key", "--name", "nobody", "--dir", str(folder)], capture_output=True,
                             text=True)
    assert refused.returncode == 1 and "not a member" in refused.stderr
