"""Whether a call's hops were checked as its `verify` level asks reaches its client: the done frame's
`verification` (`met` / `unmet`, absent at `none`), one `unmet` choice making a request of `n` choices `unmet`, and
the gateway's `Hearth-Verification` header on a whole answer (a streamed one's headers go out before its last frame).
`unmet`: a hop that no replica (or, for `vote`, not two) could check, whose record broke, or whose last work went
unchecked when the answer ended. Over real processes: tests/e2e/test_verification_unmet.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, Usage
from hearth.services.orchestrator import mirrored_checks
from hearth.services.orchestrator.choices import ChoiceGroup
from hearth.services.transport import FrameKind
from tests.unit.test_report_check_race import HeldMirror
from tests.unit.test_verify_gaps import StandInMirror, run_step, verifier_of
from tests.unit.test_withdrawn_tokens import chat_body, gateway  # noqa: F401 (a fixture)


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
