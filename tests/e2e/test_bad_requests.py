"""Every bad `llm.chat.request` is refused early by a real orchestrator, with `bad_request` naming the field and
nothing crashed: a hypothesis fuzz of raw request bodies (wrong types, huge and subnormal numbers, NaN and
Infinity as raw JSON, empty stop strings, path-like model names) gets a final frame for every body and never
`internal_error`; a 1 M-character prompt is refused in under a second; a body over `max_request_bytes` is refused
before it is parsed; a model name is never opened as a path; large bodies leave the orchestrator's memory flat.

One mesh serves the module: nats-server, one shard host with all six layers of `tiny-llama` (context 1024), and
an orchestrator serving it from a models folder."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.devtools.managed_process import ManagedProcess
from hearth.services.client.chat import stream_chat_raw
from hearth.protocol.chat import max_prompt_chars
from hearth.services.common.config import OrchestratorSettings
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_CONTEXT_LENGTH, TINY_LAYERS, TINY_MODEL_NAME, start_orchestrator

pytestmark = [pytest.mark.scheduled_first, pytest.mark.e2e, pytest.mark.timeout(600)]

FUZZ_EXAMPLES = 1000
MAX_REQUEST_BYTES = OrchestratorSettings().max_request_bytes
# What the issue asks: a 1 M-character prompt refused in under a second, every other bad input within 100 ms.
MILLION_PROMPT_WITHIN_S = 1.0
REFUSAL_WITHIN_S = 0.1
# Generous: an answered request's final frame comes within this even on a busy machine.
FINAL_FRAME_WITHIN_S = 60.0
# Three 1 MB bodies at once leave the orchestrator this much bigger at most (it grew 3.7 GB before).
LARGE_BODIES_RSS_ALLOWANCE_BYTES = 200 * 1024 * 1024


@dataclass
class RequestMesh:
    cluster: LocalCluster
    orchestrator: ManagedProcess
    models_dir: object


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir) -> Iterator[RequestMesh]:
    with LocalCluster(work_dir=tmp_path_factory.mktemp("bad-requests"), torch_threads=1) as cluster:
        cluster.start_nats()
        cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), 0, TINY_LAYERS - 1, node_id="whole",
                            wait_ready=False)
        orchestrator = start_orchestrator(cluster, tiny_models_dir)
        try:
            cluster.wait_all_ready()
            yield RequestMesh(cluster, orchestrator, tiny_models_dir)
        finally:
            for process in cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


class LoopThread:
    """An event loop in a thread with one NATS connection: hypothesis drives a synchronous test, each example
    runs its request on this loop."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()
        self.nc = self.run(connect_nats(cluster.nats_url, name="fuzz-client", settings=cluster.nats_settings()))

    def run(self, coroutine, timeout_s: float = FINAL_FRAME_WITHIN_S + 10):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.run(self.nc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def client_loop(mesh) -> Iterator[LoopThread]:
    loop = LoopThread(mesh.cluster)
    yield loop
    loop.close()


@pytest.fixture
async def nc(mesh):
    client = await connect_nats(mesh.cluster.nats_url, name="bad-requests", settings=mesh.cluster.nats_settings())
    yield client
    await client.close()


async def final_frame(nc, payload: bytes) -> tuple[object, float]:
    """The call's final frame and the seconds from publishing to it."""
    started = time.perf_counter()
    frames = [frame async for frame in stream_chat_raw(nc, payload, first_frame_timeout=FINAL_FRAME_WITHIN_S,
                                                        frame_gap_timeout=FINAL_FRAME_WITHIN_S)]
    return frames[-1], time.perf_counter() - started


def rss_bytes(process: ManagedProcess) -> int:
    with open(f"/proc/{process.popen.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


# ----------------------------------------------------------------------------- the fuzz

PATH_LIKE_MODELS = ["/", "/tmp", ".", "..", "~", "~/models", "../models/tiny-llama", "./tiny-llama", "tiny-llama/",
                    "/etc/passwd", "a/b/c", "models/hearth-tiny-llama", "C:\\Windows", "tiny-llama\x00", "%2e%2e"]

# Bare JSON values that json.dumps writes as NaN / Infinity, and numbers JSON can carry but Python floats cannot.
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-320", "5e-324", "-0.0", "1e-300",
               "123456789012345678901234567890", "0.000000000000000000000000000000000001"]


@st.composite
def json_value(draw, depth: int = 0):
    """Any JSON value, as text (so it may hold NaN, Infinity and numbers no float can)."""
    leaves = st.one_of(
        st.sampled_from(RAW_NUMBERS),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
        st.text(max_size=20).map(json.dumps),
        st.sampled_from(["true", "false", "null"]),
    )
    if depth >= 2:
        return draw(leaves)
    return draw(st.one_of(
        leaves,
        st.lists(json_value(depth + 1), max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
        st.dictionaries(st.text(max_size=8), json_value(depth + 1), max_size=3).map(
            lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"),
    ))


def field_values(valid: st.SearchStrategy[str], invalid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A field's JSON text: mostly a valid value (so that requests get past the first check to the later ones),
    sometimes a bad one, sometimes anything at all."""
    return st.one_of(valid, valid, valid, valid, valid, valid, invalid, json_value())


text = st.text(max_size=40)
REQUEST_FIELDS = {
    "model": field_values(
        st.sampled_from([TINY_MODEL_NAME]).map(json.dumps),
        st.one_of(st.sampled_from(PATH_LIKE_MODELS), text, st.sampled_from(["org/name", "", "x" * 600])).map(
            json.dumps)),
    "prompt": field_values(st.text(min_size=1, max_size=60).map(json.dumps),
                           st.sampled_from(['""', "[]", '"\\u0000"', '" "'])),
    "messages": field_values(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                        "content": text}), min_size=1, max_size=3).map(json.dumps),
        st.one_of(st.just("[]"), st.lists(st.fixed_dictionaries({"role": text, "content": json_value()}),
                                          max_size=2).map(lambda ms: "[" + ",".join(
                                              '{"role":%s,"content":%s}' % (json.dumps(m["role"]), m["content"])
                                              for m in ms) + "]"))),
    # Small valid values keep answered calls short; 2000-8192 cannot fit the context with any prompt.
    "max_tokens": field_values(st.one_of(st.integers(1, 3), st.integers(2000, 8192)).map(str),
                               st.sampled_from(["0", "-1", "8193", "1.5", '"3"', "1e400", "NaN"])),
    "temperature": field_values(st.one_of(st.floats(0.0, 10.0).map(json.dumps),
                                          st.sampled_from(["1e-300", "1e-40", "2.2250738585072014e-308"])),
                                st.one_of(st.sampled_from(RAW_NUMBERS), st.floats().map(json.dumps))),
    "top_p": field_values(st.floats(0.0, 1.0, exclude_min=True).map(json.dumps),
                          st.one_of(st.sampled_from(RAW_NUMBERS), st.floats().map(json.dumps))),
    "top_k": field_values(st.integers(0, 50).map(str), st.integers().map(str)),
    "seed": field_values(st.integers(0, 2**63 - 1).map(str), st.integers().map(str)),
    "stop": field_values(st.lists(st.text(min_size=1, max_size=8), max_size=3).map(json.dumps),
                         st.sampled_from(['[""]', '["a", ""]', json.dumps(["s"] * 17), json.dumps(["x" * 300])])),
    "params": field_values(st.sampled_from(['{"fallback_to_local": false}', "{}"]),
                           st.sampled_from(['{"fallback_to_local": "no"}', '{"unknown": 1}', "[]"])),
    "request_id": field_values(st.text(min_size=1, max_size=20).map(json.dumps),
                               st.sampled_from(['""', json.dumps("r" * 200)])),
}
UNKNOWN_FIELD = "surprise"


@st.composite
def request_body(draw) -> bytes:
    """The bytes of one `llm.chat.request`: a JSON object of some of the fields, or something else entirely."""
    shape = draw(st.sampled_from(["object"] * 18 + ["json", "bytes"]))
    if shape == "json":
        return draw(json_value()).encode()
    if shape == "bytes":
        return draw(st.binary(max_size=64))
    names = draw(st.lists(st.sampled_from(sorted(REQUEST_FIELDS)), unique=True, max_size=len(REQUEST_FIELDS)))
    # (sampled_from leans to its first element, which hypothesis takes as the simplest: the common case first.)
    if draw(st.sampled_from([False] * 9 + [True])):
        names.append(UNKNOWN_FIELD)
    if draw(st.sampled_from([True] * 4 + [False])):  # usually one of the two inputs, as a client would send
        names = [name for name in names if name not in ("prompt", "messages")] + [draw(st.sampled_from(
            ["prompt", "messages"]))]
    if "max_tokens" not in names:  # its default (128 tokens) would make every answered call long
        names.append("max_tokens")
    fields = ",".join(f"{json.dumps(name)}:{draw(REQUEST_FIELDS.get(name, json_value()))}" for name in names)
    body = "{" + fields + "}"
    if draw(st.sampled_from([False] * 19 + [True])):
        body = body[: draw(st.integers(0, len(body)))]  # cut short
    return body.encode("utf-8", "surrogatepass")


@dataclass
class FuzzLog:
    codes: dict[str, int]
    refusal_s: list[float]


def test_fuzzed_requests_all_get_a_final_frame_and_none_is_an_internal_error(mesh, client_loop):
    log = FuzzLog({}, [])
    rss_before = rss_bytes(mesh.orchestrator)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(payload=request_body())
    def one_request(payload: bytes) -> None:
        final, seconds = client_loop.run(final_frame(client_loop.nc, payload))
        kind = getattr(final, "code", None) or final.type
        log.codes[kind] = log.codes.get(kind, 0) + 1
        assert kind != "internal_error", (payload[:300], final)
        assert kind != "orchestrator_gone", (payload[:300], final)  # unanswered
        assert final.type in ("done", "error", "pipeline_aborted"), final
        if kind == "bad_request":
            log.refusal_s.append(seconds)
            assert final.message  # names what is wrong

    one_request()
    examples = sum(log.codes.values())
    refusals = sorted(log.refusal_s)
    p95 = refusals[int(0.95 * (len(refusals) - 1))]
    print(f"fuzz: {examples} requests, final frames {log.codes}; bad_request in median "
          f"{statistics.median(refusals) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, max {refusals[-1] * 1000:.1f} ms; "
          f"orchestrator RSS {rss_before / 2**20:.0f} -> {rss_bytes(mesh.orchestrator) / 2**20:.0f} MiB")
    assert examples >= FUZZ_EXAMPLES
    assert log.codes.get("bad_request", 0) > examples / 2 and log.codes.get("done", 0) > 0
    assert statistics.median(refusals) < REFUSAL_WITHIN_S
    assert mesh.orchestrator.alive


# ----------------------------------------------------------------------------- named cases

async def test_a_million_character_prompt_is_refused_in_under_a_second(mesh, nc):
    for body in ({"model": TINY_MODEL_NAME, "prompt": "a" * max_prompt_chars},
                 {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "b" * max_prompt_chars}]}):
        final, seconds = await final_frame(nc, json.dumps(body).encode())
        print(f"1 M-character {next(iter(set(body) - {'model'}))}: {final.code} in {seconds * 1000:.0f} ms")
        assert final.type == "error" and final.code == "bad_request", final
        # No max_tokens given: the prompt alone leaves no room for an answer.
        assert "leave no room for an answer" in final.message, final
        assert f"context of {TINY_CONTEXT_LENGTH} tokens" in final.message, final
        assert ("'prompt'" in final.message) or ("'messages'" in final.message)
        assert seconds < MILLION_PROMPT_WITHIN_S


async def test_prompt_tokens_plus_max_tokens_over_the_context_names_both_numbers(mesh, nc):
    # Multi-byte characters take several tokens each: short enough to be tokenized, too long to fit.
    max_tokens = TINY_CONTEXT_LENGTH - 100
    body = {"model": TINY_MODEL_NAME, "prompt": "東京 " * 100, "max_tokens": max_tokens}
    final, seconds = await final_frame(nc, json.dumps(body).encode())
    assert final.code == "bad_request", final
    assert re.search(rf"the prompt's (\d+) tokens plus max_tokens {max_tokens} = (\d+) exceed the model's "
                     rf"context of {TINY_CONTEXT_LENGTH} tokens", final.message), final.message
    assert seconds < REFUSAL_WITHIN_S * 10


async def test_a_body_over_max_request_bytes_is_refused_before_parsing(mesh, nc):
    body = json.dumps({"model": TINY_MODEL_NAME, "prompt": "c" * (MAX_REQUEST_BYTES + 10)}).encode()
    final, seconds = await final_frame(nc, body)
    assert final.code == "bad_request", final
    assert final.message == f"body: {len(body)} bytes is over max_request_bytes {MAX_REQUEST_BYTES}"
    assert seconds < MILLION_PROMPT_WITHIN_S


@pytest.mark.parametrize("model", PATH_LIKE_MODELS + ["ABSOLUTE_CHECKPOINT"])
async def test_a_model_name_is_never_opened_as_a_path(mesh, nc, model):
    if model == "ABSOLUTE_CHECKPOINT":  # a real checkpoint on this machine, but not in the catalog by that name
        model = str(mesh.models_dir / TINY_MODEL_NAME)
    final, seconds = await final_frame(nc, json.dumps({"model": model, "prompt": "hi"}).encode())
    assert final.code == "bad_request" and "field 'model'" in final.message, final
    # Nothing of this machine's file system is told (the caller's own text may be echoed back).
    leaked = final.message.replace(repr(model), "")
    assert str(mesh.models_dir) not in leaked and "/tmp/" not in leaked and "snapshot" not in leaked
    assert seconds < MILLION_PROMPT_WITHIN_S


async def test_three_large_bodies_at_once_leave_the_orchestrator_flat_and_serving(mesh, nc):
    rss_before = rss_bytes(mesh.orchestrator)
    bodies = [json.dumps({"model": TINY_MODEL_NAME, "prompt": "d" * (max_prompt_chars - 100)}).encode(),
              json.dumps({"model": TINY_MODEL_NAME, "prompt": "é" * (max_prompt_chars // 2)}).encode(),
              json.dumps({"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "e" * 300_000}] * 3}
                         ).encode()]
    finals = await asyncio.gather(*(final_frame(nc, body) for body in bodies))
    rss_after = rss_bytes(mesh.orchestrator)
    print(f"three ~1 MB bodies: {[(f.code, round(s * 1000)) for f, s in finals]} ms; orchestrator RSS "
          f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert all(final.code == "bad_request" for final, _ in finals), finals
    assert rss_after - rss_before < LARGE_BODIES_RSS_ALLOWANCE_BYTES
    final, _ = await final_frame(nc, json.dumps({"model": TINY_MODEL_NAME, "prompt": "still there?",
                                                 "max_tokens": 2}).encode())
    assert final.type == "done", final
