"""Whether a call's hops were checked as its `verify` level asks reaches its client: the done frame's
`verification` (`met` / `unmet`, absent at `none`), one `unmet` choice making a request of `n` choices `unmet`, and
the gateway's `Hearth-Verification` header on a whole answer (a streamed one's headers go out before its last frame)
and `hearth_verification` field of a whole answer and of a stream's chunks sent once the call ended, read by
OpenAI's own client.
`unmet`: a hop that no replica (or, for `vote`, not two) could check, whose record broke, or whose last work went
unchecked when the answer ended. Over real processes: tests/e2e/test_verification_unmet.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hearth.protocol.chat_frames import ChoiceEnd, DoneFrame, TokenDeltaFrame, Usage
from hearth.services.orchestrator import mirrored_checks
from hearth.services.orchestrator.choices import ChoiceGroup
from hearth.services.transport import FrameKind
from tests.unit.test_report_check_race import HeldMirror
from tests.unit.test_verify_gaps import StandInMirror, run_step, verifier_of
from tests.unit.test_gateway_openai_conformance import openai_client
from tests.unit.test_withdrawn_tokens import MODEL, chat_body, events_of, gateway  # noqa: F401 (a fixture)

MESSAGES = [{"role": "user", "content": "hi"}]


def done(verification: str | None) -> DoneFrame:
    return DoneFrame(seq=1, finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1),
                     verification=verification)


def test_the_done_frame_says_it_only_where_a_level_was_asked():
    assert done("unmet").model_dump(mode="json")["verification"] == "unmet"
    assert "verification" not in done(None).model_dump(mode="json")


def test_one_unmet_choice_makes_the_request_unmet():
    group = ChoiceGroup(SimpleNamespace(client_gone=None), ctx=None)
    calls = [object()] * 3
    group.finals = {0: done("met"), 1: done("unmet"), 2: done("met")}
    assert group._last_frame(calls).verification == "unmet"
    group.finals = {index: done("met") for index in range(3)}
    assert group._last_frame(calls).verification == "met"


async def test_a_whole_answer_carries_the_verification_header(gateway):
    http, scripted = gateway
    for said, header in (("unmet", "unmet"), ("met", "met"), (None, None)):
        scripted.scripts.append([TokenDeltaFrame(seq=0, text="Hi", token_id=1), done(said)])
        response = await http.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 200
        assert response.headers.get("hearth-verification") == header


@pytest.mark.parametrize("said", ["met", "unmet", None])
async def test_a_whole_answer_s_body_carries_it_for_openai_s_client(gateway, said):
    http, scripted = gateway
    scripted.scripts.append([TokenDeltaFrame(seq=0, text="Hi", token_id=1), done(said)])
    answer = await openai_client(http).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert answer.choices[0].message.content == "Hi"
    assert (answer.model_extra or {}).get("hearth_verification") == said


@pytest.mark.parametrize("said", ["met", "unmet", None])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_streamed_answer_s_last_chunks_carry_it_for_openai_s_client(gateway, said, include_usage):
    """The chunk that ends each choice (its finish_reason) and the usage chunk: the call's verification is known
    only once it ended, so no chunk before them says it."""
    http, scripted = gateway
    ends = [ChoiceEnd(choice=choice, finish_reason="stop", completion_tokens=1) for choice in (0, 1)]
    scripted.scripts.append([TokenDeltaFrame(seq=0, text="Hi", token_id=1),
                             TokenDeltaFrame(seq=1, text="!", token_id=2, choice=1),
                             done(said).model_copy(update={"seq": 2, "choices": ends})])
    stream = await openai_client(http).chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, stream=True,
        stream_options={"include_usage": True} if include_usage else None)
    chunks = [chunk async for chunk in stream]
    ending = [chunk for chunk in chunks if chunk.usage is not None or any(c.finish_reason for c in chunk.choices)]
    assert len(ending) == 2 + include_usage and ending == chunks[-len(ending):]
    assert [(chunk.model_extra or {}).get("hearth_verification") for chunk in chunks] == \
        [None] * (len(chunks) - len(ending)) + [said] * len(ending)


async def test_a_streamed_completion_s_last_chunks_carry_it(gateway):
    http, scripted = gateway
    scripted.scripts.append([TokenDeltaFrame(seq=0, text="Hi", token_id=1), done("unmet")])
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                         "stream_options": {"include_usage": True}})
    chunks = [json.loads(event) for event in events_of(response)[:-1]]
    assert [chunk.get("hearth_verification") for chunk in chunks] == [None, "unmet", "unmet"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 1


async def verifier_with(monkeypatch, level: str, replicas: list):
    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return replicas.pop(0) if replicas else None

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    verifier, recorder, _ = await verifier_of(level)
    run_step(recorder, 1, FrameKind.prefill, 0, 3)
    verifier.after_step()
    return verifier


@pytest.mark.parametrize("level", ["sampled", "all", "vote"])
async def test_a_hop_no_replica_checks_leaves_the_level_unmet(monkeypatch, level):
    verifier = await verifier_with(monkeypatch, level, [])
    assert await verifier.verify_step() is None and await verifier.settle() is None
    assert verifier.outcome() == "unmet"


@pytest.mark.parametrize("level", ["sampled", "all"])
async def test_a_hop_its_replicas_checked_meets_the_level(monkeypatch, level):
    verifier = await verifier_with(monkeypatch, level, [StandInMirror("second")])
    assert await verifier.verify_step() is None and await verifier.settle() is None
    assert verifier.outcome() == "met"


async def test_a_vote_with_one_replica_is_unmet(monkeypatch):
    verifier = await verifier_with(monkeypatch, "vote", [StandInMirror("second")])
    assert await verifier.verify_step() is None and await verifier.settle() is None
    assert verifier.outcome() == "unmet"


async def test_a_check_still_running_when_the_answer_ends_leaves_the_level_unmet(monkeypatch):
    stuck = HeldMirror("stuck")
    verifier = await verifier_with(monkeypatch, "sampled", [stuck])
    verifier.settings.settle_timeout_s = 0.1
    assert await verifier.settle() is None
    assert verifier.outcome() == "unmet"
    await verifier.detach()


async def test_a_call_that_asked_for_no_checks_says_nothing(monkeypatch):
    verifier = await verifier_with(monkeypatch, "none", [])
    assert await verifier.settle() is None
    assert verifier.outcome() is None
