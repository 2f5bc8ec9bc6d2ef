"""End to end with a client that shares no code with hearth: clients/node/hearth_client.mjs against a real mesh, and
against scripted stand-ins for orchestrators (frames sent again, a conversation pinned to the orchestrator that
answered its last turn)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.protocol.chat_frames import max_withdrawals_per_choice
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, MODELS_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.services.broker.connection import connect_nats, flush_ordered
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from tests.scripted_orchestrators import ScriptedOrchestrators

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "node"
SCRIPT = CLIENT_DIR / "hearth_client.mjs"
PROMPT = "the lazy dog"
MAX_TOKENS = 8
NODE_MEMBER = "node-client"
SCRIPTED_MODEL = "scripted"
# Two busy cores shared with other test runs: generous waits (the protocol's defaults are 10 s and 2.5 s).
NODE_TIMEOUT_ARGS = ["--connect-timeout", "30", "--first-frame-timeout", "30", "--silence-timeout", "10"]
NPM_CI_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                       reason="node or npm is not on PATH: the Node.js client (clients/node) cannot run"),
]


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """`node hearth_client.mjs`, after `npm ci` from the committed lock when node_modules is missing or stale."""
    installed = CLIENT_DIR / "node_modules" / ".package-lock.json"
    # One `npm ci` at a time on this machine: it deletes node_modules first, under any other run's feet.
    with open(Path(tempfile.gettempdir()) / "hearth-node-client-npm-ci.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed.exists() or installed.stat().st_mtime < (CLIENT_DIR / "package-lock.json").stat().st_mtime:
            completed = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, capture_output=True,
                                       text=True, timeout=NPM_CI_TIMEOUT_S)
            assert completed.returncode == 0, f"npm ci in {CLIENT_DIR} failed:\n{completed.stdout}\n{completed.stderr}"
    return ["node", str(SCRIPT)]


@pytest.fixture(scope="module")
def running_mesh(tmp_path_factory, tiny_models_dir):
    """nats-server (secure: members only), 3 shard hosts and an orchestrator serving the tiny model."""
    with three_shard_mesh(tmp_path_factory.mktemp("node-mesh"), tiny_models_dir) as mesh:
        yield mesh


def node_credentials(mesh: LocalCluster) -> list[str]:
    """The Node client's login on the secure mesh: client member `node-client`'s nkey seed and its own inboxes."""
    return ["--creds", str(mesh.member_key(NODE_MEMBER, "client")), "--inbox-prefix", f"_INBOX.{NODE_MEMBER}"]


def run_node(node_client: list[str], mesh: LocalCluster, *args: str, login: bool = True) -> subprocess.CompletedProcess:
    credentials = node_credentials(mesh) if login else []
    return subprocess.run([*node_client, "--nats", mesh.nats_url, *credentials, *NODE_TIMEOUT_ARGS, *args],
                          capture_output=True, text=True, timeout=120)


def greedy_reference(model_path: Path, prompt: str, new_tokens: int) -> tuple[list[int], str]:
    """Token ids and text of transformers' own greedy generate() on the same checkpoint; the text decoded as the
    orchestrator decodes it (special tokens skipped)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
    ids = output[0, len(prompt_ids):].tolist()
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


async def test_node_client_discovers_the_model_and_streams_what_generate_and_the_python_client_get(
    node_client, running_mesh, tiny_models_dir
):
    completed = await asyncio.to_thread(run_node, node_client, running_mesh, "--max-tokens", str(MAX_TOKENS), PROMPT)
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    summary = json.loads(completed.stdout.strip().splitlines()[-1])

    assert summary["models"] == [TINY_MODEL_NAME] and summary["default_model"] == TINY_MODEL_NAME
    assert {"pipeline", "token_delta", "done"} <= set(summary["frame_types"])
    assert summary["frame_types"][-1] == "done"
    assert summary["text"]

    reference_ids, reference_text = greedy_reference(tiny_models_dir / TINY_MODEL_NAME, PROMPT, MAX_TOKENS)
    assert summary["token_ids"] == reference_ids
    assert summary["text"] == reference_text
    assert summary["usage"]["completion_tokens"] == len(reference_ids)

    # The bundled Python client, same request on the same mesh, gets the same answer.
    nc = await connect_nats(running_mesh.nats_url, name="e2e-python-client", settings=running_mesh.nats_settings())
    try:
        result = await chat(nc, ChatRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0),
                            first_frame_timeout=30)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    assert result.ok, result.final
    assert (summary["text"], summary["token_ids"]) == (result.text, result.token_ids)
    assert summary["finish_reason"] == result.final.finish_reason
    assert summary["usage"] == result.final.usage.model_dump()


def test_node_client_asks_for_json_and_the_random_model_answers_json_valid_against_the_schema(
    node_client, running_mesh
):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["word", "n"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    completed = run_node(node_client, running_mesh, "--max-tokens", "200", "--response-format",
                         json.dumps(response_format), PROMPT)
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    answer = json.loads(summary["text"])
    assert set(answer) == {"word", "n"} and len(answer["word"]) <= 8 and isinstance(answer["n"], int)
    assert summary["finish_reason"] == "stop"


def test_node_client_refuses_a_request_that_breaks_the_schema(node_client, running_mesh):
    completed = run_node(node_client, running_mesh, "--self-test-invalid", PROMPT)
    assert completed.returncode == 2, completed.stderr
    assert "the chat request breaks llm.chat.request.json: /max_tokens must be integer" in completed.stderr
    assert completed.stdout == ""


def test_node_client_validates_every_frame_against_the_schema_its_type_names(node_client, running_mesh, tmp_path):
    # The same schemas with one field hearth does not send made required in frame.token_delta.json.
    schemas = shutil.copytree(ROOT / "docs" / "schemas", tmp_path / "schemas")
    token_delta = json.loads((schemas / "frame.token_delta.json").read_text())
    token_delta["required"].append("not_sent_by_hearth")
    (schemas / "frame.token_delta.json").write_text(json.dumps(token_delta))

    completed = run_node(node_client, running_mesh, "--schemas", str(schemas), "--max-tokens", "2", PROMPT)
    assert completed.returncode == 2, completed.stderr
    assert "a 'token_delta' frame breaks frame.token_delta.json" in completed.stderr
    assert "must have required property 'not_sent_by_hearth'" in completed.stderr
    assert completed.stdout == ""


def test_the_mesh_refuses_the_node_client_without_credentials(node_client, running_mesh):
    assert running_mesh.community is not None, "the mesh fixture must run a secure (members only) broker"
    completed = run_node(node_client, running_mesh, "--max-tokens", "2", PROMPT, login=False)
    assert completed.returncode == 2, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    assert "refused an anonymous login (authorization violation)" in completed.stderr
    assert completed.stdout == ""


def test_the_orchestrator_refuses_the_node_clients_call_unsigned(node_client, running_mesh):
    # Logged in as a member (llm.models answers), but the chat request goes out without the Hearth-Caller*
    # headers (--no-sign, testing only): the orchestrator checks signatures, so it answers `unauthorized`.
    assert running_mesh.community is not None, "the mesh fixture must run a community (signed calls) mesh"
    completed = run_node(node_client, running_mesh, "--no-sign", "--max-tokens", "2", PROMPT)
    assert completed.returncode == 1, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["models"] == [TINY_MODEL_NAME]
    assert summary["frame_types"] == ["error"] and summary["text"] == "" and summary["token_ids"] == []
    assert summary["error"]["type"] == "error" and summary["error"]["code"] == "unauthorized"
    assert "not signed" in summary["error"]["detail"]
    assert "the orchestrator refused the call as unauthorized" in completed.stderr


async def answer_models(nc) -> None:
    """Answer llm.models on `nc`: one model, the default."""
    async def models(msg) -> None:
        reply = ModelsReply(models=[ServedModel(id=SCRIPTED_MODEL, total_layers=2, complete=True)],
                            default_model=SCRIPTED_MODEL)
        await msg.respond(reply.model_dump_json().encode())

    await nc.subscribe(MODELS_REQUEST_SUBJECT, cb=models)


@pytest.fixture
async def scripted_orchestrator(nats_url):
    """A stand-in orchestrator on an open broker: it lists one model and answers each call with the next script."""
    orchestrator = await connect_nats(nats_url, name="scripted-orchestrator")
    scripts: list[list[dict]] = []

    async def answer(msg) -> None:
        for frame in scripts.pop(0):
            await orchestrator.publish(msg.reply, json.dumps(frame).encode())

    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, cb=answer)
    await answer_models(orchestrator)
    await flush_ordered(orchestrator)
    yield scripts
    await orchestrator.close()


def scripted_token(seq: int, text: str) -> dict:
    return {"type": "token_delta", "seq": seq, "text": text, "token_id": seq}


async def test_node_client_skips_frames_sent_again_and_waits_for_a_gap_to_fill(node_client, scripted_orchestrator,
                                                                                 nats_url):
    """After a broker node went away the orchestrator sends the frames it keeps again (docs/protocol.md, "Frames"):
    the Node client holds frames after a gap until it is filled and skips those it has seen; a gap never filled
    exits 2."""
    done = {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 3}}
    scripted_orchestrator.append([scripted_token(0, "He"), scripted_token(2, "lo"), scripted_token(0, "He"),
                                  scripted_token(1, "l"), {"type": "keepalive", "seq": 1}, scripted_token(2, "lo"),
                                  {**done, "seq": 3}])
    command = [*node_client, "--nats", nats_url, *NODE_TIMEOUT_ARGS[:4], "--silence-timeout", "1", PROMPT]
    completed = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert (summary["text"], summary["token_ids"]) == ("Hello", [0, 1, 2])

    scripted_orchestrator.append([scripted_token(0, "He"), scripted_token(2, "lo"), {**done, "seq": 3}])
    completed = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    assert "frames were lost: seq 1 to 1 never came" in completed.stderr


async def test_node_client_accepts_and_exposes_the_done_frames_verification(node_client, scripted_orchestrator,
                                                                             nats_url):
    """The done frame's `verification` passes the schema check and is the summary's `verification` (null when the
    frame has none); an unmet one is said on stderr too."""
    done = {"type": "done", "seq": 1, "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    command = [*node_client, "--nats", nats_url, *NODE_TIMEOUT_ARGS, PROMPT]
    for verification in ("unmet", "met", None):
        scripted_orchestrator.append([scripted_token(0, "Hi"),
                                      {**done, **({"verification": verification} if verification else {})}])
        completed = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
        summary = json.loads(completed.stdout.strip().splitlines()[-1])
        assert (summary["text"], summary["verification"]) == ("Hi", verification)
        assert ("verification unmet" in completed.stderr) == (verification == "unmet")


async def test_node_client_refuses_an_answer_past_its_request_s_bound(node_client, scripted_orchestrator, nats_url):
    """More token_delta frames than max_tokens, or more text than they can make, or more tokens_withdrawn frames than
    the protocol lets a choice have (docs/protocol.md, "How long an answer may be"), is a violation (exit code 2)
    however the frames fit their schema; an answer within the bound stands, withdrawn tokens left out."""
    done = {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    withdrawn = {"type": "tokens_withdrawn", "seq": 2, "kept_tokens": 1, "shard_id": "m:0-1@liar", "reason": "r"}
    command = [*node_client, "--nats", nats_url, *NODE_TIMEOUT_ARGS, "--max-tokens", "2", PROMPT]
    scripts = {"within": [scripted_token(0, "a"), scripted_token(1, "X"), withdrawn, scripted_token(3, "b"),
                          {**done, "seq": 4}],
               "frames": [scripted_token(0, "a"), scripted_token(1, "b"), scripted_token(2, "c"), {**done, "seq": 3}],
               "text": [scripted_token(0, "x" * 1500), {**done, "seq": 1}],
               # The answer sent, taken back and sent again, once more than any orchestrator may.
               "withdrawals": [scripted_token(0, "a"), *[frame for round_ in range(max_withdrawals_per_choice + 1)
                                                         for frame in ({**withdrawn, "seq": 2 * round_ + 1,
                                                                        "kept_tokens": 0},
                                                                       scripted_token(2 * round_ + 2, "a"))],
                               {**done, "seq": 2 * max_withdrawals_per_choice + 3}]}
    for case, frames in scripts.items():
        scripted_orchestrator.append(frames)
        completed = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        outcome = f"{case}: stdout: {completed.stdout}\nstderr: {completed.stderr}"
        if case == "within":
            assert completed.returncode == 0 and json.loads(completed.stdout)["text"] == "ab", outcome
        else:
            assert completed.returncode == 2 and "choice 0 got more" in completed.stderr, outcome


def summaries(completed: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in completed.stdout.strip().splitlines()]


def test_node_client_pins_a_conversation_to_the_orchestrator_that_answered_signed_over_its_subject(
    node_client, running_mesh
):
    # Signed over the orchestrator's own subject: signed over llm.chat.request, the call would be `unauthorized`.
    completed = run_node(node_client, running_mesh, "--max-tokens", "3", "--then", "and then?", PROMPT)
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    first, second = summaries(completed)
    assert first["subjects"] == [CHAT_REQUEST_SUBJECT] and first["orchestrator"]
    assert second["subjects"] == [orchestrator_request_subject(first["orchestrator"])]
    assert second["orchestrator"] == first["orchestrator"] and "fell_back" not in second
    assert (first["turn"], second["turn"]) == (0, 1) and second["frame_types"][-1] == "done"

    # Pinned to an orchestrator that is gone: nobody listens on its subject, so the call goes to the queue group.
    completed = run_node(node_client, running_mesh, "--max-tokens", "2", "--orchestrator", "long gone", PROMPT)
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    (summary,) = summaries(completed)
    assert summary["subjects"] == ["llm.chat.request.long_gone", CHAT_REQUEST_SUBJECT]
    assert summary["fell_back"] == "no_responders" and summary["orchestrator"] == first["orchestrator"]


AWKWARD_NODE_IDS = ["kitchen-pc", "kitchen pc.local", "a*b>c", "", "küche_2", "e\u0301", "Ⅻ²٣", "日本", "🔥x", "x\ty"]


def test_node_client_makes_an_orchestrator_s_subject_as_python_does(node_client):
    script = (f"import {{ orchestratorRequestSubject }} from {json.dumps(SCRIPT.as_uri())};"
              f"console.log(JSON.stringify({json.dumps(AWKWARD_NODE_IDS)}.map(orchestratorRequestSubject)));")
    completed = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True,
                               timeout=60, cwd=CLIENT_DIR)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == [orchestrator_request_subject(node_id) for node_id in AWKWARD_NODE_IDS]


@pytest.fixture
async def scripted_orchestrators(nats_url):
    """Two scripted orchestrators on an open broker (one named with a space and a dot), and the llm.models answer."""
    nc = await connect_nats(nats_url, name="scripted-orchestrators")
    await answer_models(nc)
    orchestrators = ScriptedOrchestrators(nc)
    for name in ("kitchen pc.local", "attic-box"):
        await orchestrators.start(name)
    yield orchestrators
    await nc.close()


def run_scripted(node_client: list[str], nats_url: str, *args: str) -> subprocess.CompletedProcess:
    command = [*node_client, "--nats", nats_url, *NODE_TIMEOUT_ARGS, "--max-tokens", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


async def test_node_client_sends_each_next_turn_to_the_orchestrator_that_answered_the_last(
    node_client, scripted_orchestrators, nats_url
):
    completed = await asyncio.to_thread(run_scripted, node_client, nats_url, "--then", "and then?", "--then",
                                        "and after that?", "hello")
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    turns = summaries(completed)
    first = turns[0]["orchestrator"]
    assert [turn["orchestrator"] for turn in turns] == [first] * 3
    assert scripted_orchestrators.heard == {first: [CHAT_REQUEST_SUBJECT] + [orchestrator_request_subject(first)] * 2}
    assert [turn["subjects"] for turn in turns[1:]] == [[orchestrator_request_subject(first)]] * 2
    requests = scripted_orchestrators.requests
    assert [len(request.messages) for request in requests] == [1, 3, 5] and requests[0].prompt is None
    assert [(m.role, m.content) for m in requests[-1].messages] == [
        ("user", "hello"), ("assistant", "ok"), ("user", "and then?"), ("assistant", "ok"), ("user", "and after that?")]


@pytest.mark.parametrize(("pinned", "answers", "fell_back"), [
    ("gone-box", None, "no_responders"),
    ("busy-box", [{"type": "error", "seq": 0, "code": "overloaded", "message": "full", "retry_after_s": 1.0}],
     "overloaded"),
    ("mute-box", [], "orchestrator_gone"),
])
async def test_a_pinned_node_client_call_the_orchestrator_cannot_take_goes_to_the_queue_group(
    node_client, scripted_orchestrators, nats_url, pinned, answers, fell_back
):
    if answers is not None:
        scripted_orchestrators.answers[pinned] = answers
        await scripted_orchestrators.start(pinned, in_queue=False)
    # At once, not after the first-frame timeout (60 s here) but after a silence (--silence-timeout, 2.5 s): a pinned
    # call's first frame is waited for no longer, as an orchestrator that took it sends keepalives.
    wait = ["--first-frame-timeout", "60"] if pinned == "mute-box" else []
    started = time.monotonic()
    completed = await asyncio.to_thread(run_scripted, node_client, nats_url, *wait, "--orchestrator", pinned, "hi")
    assert completed.returncode == 0, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    assert time.monotonic() - started < 40
    (summary,) = summaries(completed)
    assert summary["subjects"] == [orchestrator_request_subject(pinned), CHAT_REQUEST_SUBJECT]
    assert summary["fell_back"] == fell_back and summary["orchestrator"] in ("kitchen pc.local", "attic-box")
    assert f"pinned to orchestrator {pinned} went to llm.chat.request: {fell_back}" in completed.stderr
    assert scripted_orchestrators.heard[pinned] == ([] if answers is None else [orchestrator_request_subject(pinned)])


async def test_a_pinned_node_client_call_keeps_any_other_ending(node_client, scripted_orchestrators, nats_url):
    # A refusal other than `overloaded` is the answer; so is `overloaded` after a token (the text would come twice).
    scripted_orchestrators.answers["busy-box"] = [{"type": "error", "seq": 0, "code": "bad_request", "message": "no"}]
    await scripted_orchestrators.start("busy-box", in_queue=False)
    completed = await asyncio.to_thread(run_scripted, node_client, nats_url, "--orchestrator", "busy-box", "hi")
    assert completed.returncode == 1, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    (summary,) = summaries(completed)
    assert summary["error"]["code"] == "bad_request" and "fell_back" not in summary
    scripted_orchestrators.answers["busy-box"] = [
        scripted_token(0, "a"), {"type": "pipeline_aborted", "seq": 1, "code": "overloaded", "reason": "x"}]
    completed = await asyncio.to_thread(run_scripted, node_client, nats_url, "--orchestrator", "busy-box", "hi")
    assert completed.returncode == 1, f"stdout: {completed.stdout}\nstderr: {completed.stderr}"
    (summary,) = summaries(completed)
    assert summary["error"]["code"] == "overloaded" and summary["text"] == "a" and "fell_back" not in summary
    assert summary["subjects"] == [orchestrator_request_subject("busy-box")]
    assert not scripted_orchestrators.heard["kitchen pc.local"] and not scripted_orchestrators.heard["attic-box"]
