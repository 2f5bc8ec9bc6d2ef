"""No member fills every stream of a shard with hops of its own: on a community mesh an orchestrator signs its `open`s
with its member key, and the shard lets one opener (a roster member) hold at most `[shard] max_hops_per_opener` of its
hops (by default all but one of max_concurrent_streams), so another orchestrator still finds room; a re-open of an
opener's own hop takes no further place, and an open that does not verify takes none."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from hearth.protocol.control import CloseHop, ControlReply, OpenHop
from hearth.services.common.call_signing import CallVerifier, signed_call_headers
from hearth.services.orchestrator.hop_owner import open_signer, owner_key
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0


def _open(pipeline_id: str, session_id: str = "s") -> bytes:
    return OpenHop(pipeline_id=pipeline_id, session_id=session_id, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   owner_key=owner_key(pipeline_id, "tiny-0-1")).model_dump_json().encode()


async def _ask(shard, body: bytes, key: MemberKey | None) -> ControlReply:
    sign = open_signer(key)  # as an orchestrator signs its opens (HopChain)
    headers = sign(shard.subject, body) if sign is not None else None
    message = await shard.client.request(shard.subject, body, timeout=reply_timeout_s, headers=headers)
    return ControlReply.model_validate_json(message.data)


async def test_one_orchestrator_holds_at_most_its_share_of_a_shards_streams(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", "4")
    hogger, other = MemberKey.generate(), MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    roster = roster.with_member(new_member("hogger", "orchestrator", hogger.public_key, "trusted"))
    roster = roster.with_member(new_member("other", "orchestrator", other.public_key, "trusted"))
    async with tiny_shard_server(nats_server.url) as shard:
        # As a host with the community's roster has it (hearth/services/common/event_trust.py, open_verifier).
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
        for index in range(3):
            assert (await _ask(shard, _open(f"hog-{index}"), hogger)).ok
        refused = await _ask(shard, _open("hog-3"), hogger)
        assert (refused.ok, refused.code) == (False, "at_capacity")
        assert "3 of" in refused.message
        # A re-open of its own hop (a failover's new session) takes that hop's place, not another.
        assert (await _ask(shard, _open("hog-0", session_id="s2"), hogger)).ok
        # Another orchestrator still finds the last stream; then the shard is full for everyone.
        assert (await _ask(shard, _open("other-0"), other)).ok
        assert (await _ask(shard, _open("other-1"), other)).code == "at_capacity"
        # A hop closed gives its opener's place back.
        await shard.client.request(shard.subject, CloseHop(pipeline_id="hog-2", owner_key=owner_key(
            "hog-2", "tiny-0-1")).model_dump_json().encode(), timeout=reply_timeout_s)
        assert (await _ask(shard, _open("hog-4"), hogger)).ok
        assert shard.server.active_streams == 4


async def test_on_an_open_mesh_one_orchestrator_may_take_every_stream(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", "3")
    async with tiny_shard_server(nats_server.url) as shard:
        assert shard.server.open_verifier is None  # no roster: nobody's open can be told from another's
        for index in range(3):
            assert (await _ask(shard, _open(f"p-{index}"), None)).ok
        assert (await _ask(shard, _open("p-3"), None)).code == "at_capacity"


async def test_a_member_at_its_share_gets_no_stream_by_an_open_that_does_not_verify(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", "2")
    hogger = MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc)).with_member(
        new_member("hogger", "orchestrator", hogger.public_key, "trusted"))
    async with tiny_shard_server(nats_server.url) as shard:
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
        assert (await _ask(shard, _open("hog-0"), hogger)).ok  # its share: 1 of 2
        body = _open("hog-1")
        headers = open_signer(hogger)(shard.subject, body)
        first = ControlReply.model_validate_json((await shard.client.request(
            shard.subject, body, timeout=reply_timeout_s, headers=headers)).data)
        assert (first.ok, first.code) == (False, "at_capacity")
        # Sent again as it was (its nonce now seen), unsigned, or signed by a key of no member: none takes the
        # stream its share leaves to the others.
        again = ControlReply.model_validate_json((await shard.client.request(
            shard.subject, body, timeout=reply_timeout_s, headers=headers)).data)
        assert (again.ok, again.code) == (False, "unauthorized")
        assert (await _ask(shard, _open("hog-2"), None)).code == "unauthorized"
        assert (await _ask(shard, _open("hog-3"), MemberKey.generate())).code == "unauthorized"
        assert shard.server.active_streams == 1


async def test_an_open_signed_on_a_clock_far_off_the_shards_is_refused_saying_so(nats_server):
    late = MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc)).with_member(
        new_member("late", "orchestrator", late.public_key, "trusted"))
    async with tiny_shard_server(nats_server.url) as shard:
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member",
                                                  signed="open", receiver="shard")
        body = _open("late-0")
        headers = signed_call_headers(late, shard.subject, "", body, now_s=time.time() - 95)  # its clock is slow
        refused = ControlReply.model_validate_json((await shard.client.request(
            shard.subject, body, timeout=reply_timeout_s, headers=headers)).data)
        assert (refused.ok, refused.code) == (False, "unauthorized")
        assert "the open is dated about 95 s behind this shard's clock" in refused.message
        assert "NTP" in refused.message and shard.server.active_streams == 0
