"""No member takes a shard's KV cache from the others: on a community mesh every hop reserves the KV its session may
reach (its declared max_session_tokens in the layers it runs), and one opener's hops reserve at most `[shard]
max_kv_share_per_opener` of the shard's KV budget; an open past that is refused `at_capacity`, saying so, while
another member still opens, and its sessions are not evicted by the first member's growing ones."""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import ControlReply, OpenHop
from hearth.services.common.call_signing import CallVerifier
from hearth.services.orchestrator.hop_owner import open_signer, owner_key
from hearth.services.shard.compute import runner_session
from hearth.services.transport import FrameKind, ReceivedStep
from hearth.services.transport.frames import encode_step
from hearth.services.transport.headers import StepInfo
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
MiB = 1 << 20
# The tiny model's layers 0-1: 2 KV heads of 64 float32s, keys and values, 2 layers: 2 KiB a position, so a session of
# its whole context (512 positions) takes 1 MiB.
SESSION_BYTES = CONTEXT * 2 * 2 * 64 * 4 * 2


def _open(pipeline_id: str, tokens: int = CONTEXT, session_id: str = "s") -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id=session_id, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=tokens,
                   owner_key=owner_key(pipeline_id, "tiny-0-1"))


async def _ask(shard, request: OpenHop, key: MemberKey) -> ControlReply:
    body = request.model_dump_json().encode()
    message = await shard.client.request(shard.subject, body, timeout=reply_timeout_s,
                                         headers=open_signer(key)(shard.subject, body))
    return ControlReply.model_validate_json(message.data)


async def _fill(shard, request: OpenHop) -> None:
    """Prefill the hop's session to its whole declared length, as its chain's first step would."""
    hidden = torch.randn(1, request.max_session_tokens, 256, generator=torch.Generator().manual_seed(0))
    header = encode_step(StepInfo(session=request.session_id, step=0, kind=FrameKind.prefill, pos=0),
                         hidden).header(request.pipeline_id, 0, 0)
    result = await shard.server.compute.run(request, ReceivedStep(header, hidden, None, 0, None, 0.0))
    assert result.failed_check is None and result.output is not None


def _roster(**keys: MemberKey) -> Roster:
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    for name, key in keys.items():
        roster = roster.with_member(new_member(name, "orchestrator", key.public_key, "trusted"))
    return roster


async def test_a_member_past_its_kv_share_is_refused_while_another_still_opens_and_keeps_its_cache(
        nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", "6")  # streams enough: the KV share is what binds
    monkeypatch.setenv("HEARTH_SHARD__MAX_KV_SHARE_PER_OPENER", "0.5")
    # No orchestrator keeps these hops alive: none may be closed as orphaned (freeing its member's share) while the
    # test runs, however slowly on a loaded machine.
    monkeypatch.setenv("HEARTH_TRANSPORT__ORPHAN_TIMEOUT_S", "600")
    hogger, other = MemberKey.generate(), MemberKey.generate()
    async with tiny_shard_server(nats_server.url, cache_budget_bytes=4 * SESSION_BYTES) as shard:
        shard.server.open_verifier = CallVerifier(_roster(hogger=hogger, other=other), max_clock_skew_s=30,
                                                  min_caller_trust="member")
        theirs = [_open(f"other-{index}") for index in range(2)]
        assert (await _ask(shard, theirs[0], other)).ok
        await _fill(shard, theirs[0])  # the other member's sessions are the least recently used ones
        hogs = [_open("hog-0", CONTEXT // 2), _open("hog-1"), _open("hog-2", CONTEXT // 2)]  # 2 MiB: its share
        for request in hogs:
            assert (await _ask(shard, request, hogger)).ok
        refused = await _ask(shard, _open("hog-3", tokens=64), hogger)
        assert (refused.ok, refused.code) == (False, "at_capacity")
        assert "KV" in refused.message and "max_kv_share_per_opener" in refused.message
        # A re-open of its own hop (a failover's new session) may not grow its session past the share either.
        assert (await _ask(shard, _open("hog-0", CONTEXT, session_id="s2"), hogger)).code == "at_capacity"
        hogs[0] = _open("hog-0", CONTEXT // 2, session_id="s2")
        assert (await _ask(shard, hogs[0], hogger)).ok
        # The other member still opens, within its own share.
        assert (await _ask(shard, theirs[1], other)).ok
        await _fill(shard, theirs[1])
        assert (await _ask(shard, _open("other-2", tokens=64), other)).code == "at_capacity"
        for request in hogs:  # the hogger's sessions grow to all they reserved
            await _fill(shard, request)
        cached = await on_compute_thread(shard.runner.session_ids)
        assert {runner_session(request) for request in theirs} <= set(cached), "the other member's caches were evicted"
        assert shard.runner.evictions_total == 0


async def test_a_single_session_beyond_an_openers_share_is_refused(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_KV_SHARE_PER_OPENER", "0.25")
    member = MemberKey.generate()
    async with tiny_shard_server(nats_server.url, cache_budget_bytes=2 * SESSION_BYTES) as shard:
        shard.server.open_verifier = CallVerifier(_roster(member=member), max_clock_skew_s=30,
                                                  min_caller_trust="member")
        assert (await _ask(shard, _open("p-0"), member)).code == "at_capacity"
        assert (await _ask(shard, _open("p-1", tokens=CONTEXT // 2), member)).ok  # half a MiB: its share
        assert shard.server.active_streams == 1


async def test_by_default_no_kv_share_binds_and_a_member_over_commits_the_budget(nats_server, monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__MAX_CONCURRENT_STREAMS", "4")  # 3 hops of 4 a member
    member, other = MemberKey.generate(), MemberKey.generate()
    async with tiny_shard_server(nats_server.url, cache_budget_bytes=2 * SESSION_BYTES) as shard:
        shard.server.open_verifier = CallVerifier(_roster(member=member, other=other), max_clock_skew_s=30,
                                                  min_caller_trust="member")
        assert (await _ask(shard, _open("p-0"), member)).ok
        assert (await _ask(shard, _open("p-1", tokens=CONTEXT // 2), member)).ok
        # Past 3/4 of the budget in declared lengths: taken, the runner evicting the least recently used if they grow.
        assert (await _ask(shard, _open("p-2", tokens=CONTEXT // 2), member)).ok
        assert (await _ask(shard, _open("p-3", tokens=64), member)).code == "at_capacity"  # its hop share binds
        assert (await _ask(shard, _open("q-0", tokens=CONTEXT // 2), other)).ok
