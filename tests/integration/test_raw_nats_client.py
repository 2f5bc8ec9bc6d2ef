"""examples/raw_nats_client.py, the client written from docs/protocol.md alone, against scripted orchestrators on a
real nats-server: it reads frames in `seq` order (duplicates, a gap, keepalives, junk and unknown types), reports a
refusal, says "no orchestrator" at once, cancels by leaving its inbox, and signs calls as orchestrators verify them."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.common.call_signing import signed_by
from hearth.trust.keys import MemberKey
from tests.scripted_orchestrators import ScriptedOrchestrators, done

pytestmark = pytest.mark.integration
CLIENT_PATH = Path(__file__).resolve().parents[2] / "examples" / "raw_nats_client.py"
_spec = importlib.util.spec_from_file_location("raw_nats_client", CLIENT_PATH)
raw_client = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(raw_client)


def token(seq: int, text: str) -> dict:
    return {"type": "token_delta", "seq": seq, "text": text, "token_id": seq}


@pytest.fixture
async def scripted(nats_url):
    nc = await connect_nats(nats_url, name="scripted-orchestrators")
    orchestrators = ScriptedOrchestrators(nc)
    yield orchestrators
    await nc.close()


async def call(nats_url: str, argv: list[str], **connect) -> tuple[int, str]:
    client = await nats.connect(nats_url, **connect)
    out = io.StringIO()
    try:
        code = await raw_client.chat(client, raw_client.parse_args(argv), None, out=out)
    finally:
        await client.close()
    return code, out.getvalue()


async def test_frames_are_read_in_seq_order_to_the_final_one(nats_url, scripted):
    scripted.answers["o1"] = [
        {"type": "pipeline", "seq": 0, "pipeline_id": "p", "hops": []}, token(2, "b"),
        {"type": "keepalive", "seq": 0}, {"no": "frame"}, token(1, "a"), token(1, "a"),
        {"type": "a_newer_frame", "seq": 3}, token(4, "c"), done("o1") | {"seq": 5}]
    await scripted.start("o1")
    code, text = await call(nats_url, ["hi"])
    assert (code, text) == (0, "abc")
    assert scripted.requests[0].max_tokens == 32 and scripted.requests[0].temperature == 0.0


async def test_a_gap_that_never_fills_ends_the_call_as_stalled(nats_url, scripted, monkeypatch, capsys):
    monkeypatch.setattr(raw_client, "SILENCE_TIMEOUT_S", 0.3)  # the example's own wait, shortened for the test
    scripted.answers["o1"] = [token(0, "a"), token(2, "c"), {"type": "keepalive", "seq": 2}]
    await scripted.start("o1")
    code, text = await call(nats_url, ["hi"])
    assert (code, text) == (1, "a") and "pipeline_stalled" in capsys.readouterr().err


async def test_a_refusal_ends_the_call_with_exit_code_2(nats_url, scripted, capsys):
    scripted.answers["o1"] = [{"type": "error", "seq": 0, "code": "bad_request", "param": "messages",
                               "refusal": "context_exceeded", "message": "the prompt's 4100 tokens exceed ..."}]
    await scripted.start("o1")
    code, _ = await call(nats_url, ["hi"])
    assert code == 2 and "param=messages refusal=context_exceeded" in capsys.readouterr().err


async def test_no_orchestrator_is_said_at_once_not_after_the_first_frame_wait(nats_url, capsys):
    code, _ = await call(nats_url, ["hi"], connect_timeout=2)
    assert code == 2 and "no responders" in capsys.readouterr().err


async def test_cancelling_leaves_the_inbox_so_the_orchestrator_hears_no_responders(nats_url):
    orchestrator = await nats.connect(nats_url)
    inboxes: list[str] = []

    async def answer(msg) -> None:
        inboxes.append(msg.reply)
        for seq, text in enumerate("abc"):
            await orchestrator.publish(msg.reply, json.dumps(token(seq, text)).encode())

    await orchestrator.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators", cb=answer)
    await flush_ordered(orchestrator)
    client = await nats.connect(nats_url)
    out = io.StringIO()
    try:
        code = await raw_client.chat(client, raw_client.parse_args(["hi", "--cancel-after", "2"]), None, out=out)
        await flush_ordered(client)  # the client's UNSUB reaches the broker before the probe below
        assert (code, out.getvalue()) == (0, "ab")
        # Still connected, but nobody listens on the call's inbox: the orchestrator's next frame finds no responders.
        with pytest.raises(nats.errors.NoRespondersError):
            await orchestrator.request(inboxes[0], b"{}", timeout=2)
    finally:
        await client.close()
        await orchestrator.close()


def test_signed_headers_verify_as_an_orchestrator_checks_them(tmp_path):
    seed_file = tmp_path / "alice.nk"
    member = MemberKey.generate()
    member.save(seed_file)
    signer = raw_client.Signer(seed_file)
    body, inbox = b'{"messages": [{"role": "user", "content": "hi"}]}', "_INBOX.alice.abc"
    headers = signer.headers(CHAT_REQUEST_SUBJECT, inbox, body)
    assert signer.public_key == member.public_key
    assert signed_by(member.public_key, CHAT_REQUEST_SUBJECT, inbox, body, headers)
    assert not signed_by(member.public_key, CHAT_REQUEST_SUBJECT, "_INBOX.alice.other", body, headers)


def test_help_runs():
    shown = subprocess.run([sys.executable, str(CLIENT_PATH), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--cancel-after" in shown.stdout
