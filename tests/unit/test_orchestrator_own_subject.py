"""An orchestrator's own subject (where a conversation's next turn comes back to it): a call signed for the queue
group's subject and delivered there is refused (the signature covers the subject it came on), one signed for it is
accepted; the done frame names the orchestrator, and a client builds one subject token from whatever it names."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace
from unittest.mock import MagicMock

from hearth.protocol.chat_frames import DoneFrame, ErrorFrame, Usage, decode_frame
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.services.common.call_signing import CallVerifier, signed_call_headers
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.service import Orchestrator
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member

REPLY, BODY = "_INBOX.alice.abc", b'{"prompt": "hi"}'


def orchestrator_of_a_community() -> tuple[Orchestrator, MemberKey]:
    alice = MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc)).with_member(
        new_member("alice", "client", alice.public_key, "trusted"))
    orchestrator = Orchestrator(MagicMock(), HearthSettings(), node_id="orch-a")
    orchestrator.call_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
    return orchestrator, alice


def call_on(subject: str, signed_for: str, key: MemberKey) -> SimpleNamespace:
    return SimpleNamespace(subject=subject, reply=REPLY, data=BODY,
                           headers=signed_call_headers(key, signed_for, REPLY, BODY))


async def test_a_call_on_the_orchestrator_s_own_subject_is_checked_against_that_subject():
    orchestrator, alice = orchestrator_of_a_community()
    own = orchestrator_request_subject("orch-a")
    assert await orchestrator._caller_admitted(call_on(own, own, alice)) == "alice"
    # Signed for the queue group's subject and sent on to ours (or the other way round): not what was signed.
    for subject, signed_for in ((own, CHAT_REQUEST_SUBJECT), (CHAT_REQUEST_SUBJECT, own)):
        refusal = await orchestrator._caller_admitted(call_on(subject, signed_for, alice))
        assert isinstance(refusal, ErrorFrame) and refusal.code == "unauthorized", (subject, signed_for)


def test_the_done_frame_names_the_orchestrator_and_any_name_makes_one_subject_token():
    done = DoneFrame(seq=3, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1),
                     orchestrator="orch-a")
    assert decode_frame(done.model_dump_json().encode()).orchestrator == "orch-a"
    assert "orchestrator" not in DoneFrame(seq=3, finish_reason="stop", usage=done.usage).model_dump_json()
    assert orchestrator_request_subject("orch-a") == f"{CHAT_REQUEST_SUBJECT}.orch-a"
    assert orchestrator_request_subject("evil.>  *") == f"{CHAT_REQUEST_SUBJECT}.evil_____"
