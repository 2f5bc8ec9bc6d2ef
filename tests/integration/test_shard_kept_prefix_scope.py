"""No member poisons another's kept prefixes: on a community mesh the blocks a hop keeps are attached only by hops whose
`open` the same member signed, so an orchestrator that guesses a call's tokens and computes its block names (a
community-wide system prompt's too) cannot have another member's call begin from junk it kept under them; on an open
mesh, where opens are not told apart, any hop attaches them as before (hearth/inference/prefix_cache.py)."""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from hearth.inference import load_head
from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import CloseHop, ControlReply, OpenHop, PrefixBlocks
from hearth.services.common.call_signing import CallVerifier
from hearth.services.orchestrator.hop_owner import open_signer, owner_key
from hearth.services.orchestrator.prefix import PUBLIC_SCOPE, block_names, caller_scope, first_name
from hearth.services.shard.compute import runner_session
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.integration.tiny_shard_server import CONTEXT, MODEL, tiny_shard_server

reply_timeout_s = 5.0
BLOCK = 4
PROMPT = [1, 7, 9, 11, 13, 17, 19, 23, 29]  # two whole blocks before its last token
FIRST = first_name("tiny", "0" * 64, "", "float32", BLOCK)
# What the victim's orchestrator names its caller's blocks, and a public system prompt's (the same for every member).
VICTIM_NAMES = PrefixBlocks(block_tokens=BLOCK, hashes=block_names(PROMPT[:-1], BLOCK, FIRST, caller_scope("victor")))
PUBLIC_NAMES = PrefixBlocks(block_tokens=BLOCK, hashes=block_names(PROMPT[:-1], BLOCK, FIRST, PUBLIC_SCOPE,
                                                                   public_blocks=2))


def open_hop(pipeline_id: str, prefix: PrefixBlocks | None = None) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id=pipeline_id, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   owner_key=owner_key(pipeline_id, "tiny-0-1"), prefix=prefix)


async def ask(shard, request, key: MemberKey | None) -> ControlReply:
    body = request.model_dump_json().encode()
    sign = open_signer(key)  # as an orchestrator signs its opens (HopChain)
    headers = sign(shard.subject, body) if sign is not None and isinstance(request, OpenHop) else None
    message = await shard.client.request(shard.subject, body, timeout=reply_timeout_s, headers=headers)
    return ControlReply.model_validate_json(message.data)


async def close(shard, hop: OpenHop, key: MemberKey | None, keep: PrefixBlocks | None = None) -> None:
    assert (await ask(shard, CloseHop(pipeline_id=hop.pipeline_id, owner_key=hop.owner_key, keep=keep), key)).ok


async def keep_junk(shard, pipeline_id: str, names: PrefixBlocks, key: MemberKey | None) -> None:
    """An orchestrator of `key`'s member opens a hop, has it compute junk over the blocks' positions (as its own steps
    would) and closes it keeping them under `names`."""
    hop = open_hop(pipeline_id)
    assert (await ask(shard, hop, key)).ok
    junk = torch.randn(1, len(names.hashes) * BLOCK, shard.runner.info.hidden_size) * 5
    await on_compute_thread(shard.runner.forward, runner_session(hop), junk, 0, "prefill")
    await close(shard, hop, key, keep=names)


async def last_output(shard, hop: OpenHop, start: int) -> torch.Tensor:
    """The hop's output at the prompt's last token, its session begun at `start` (what the open attached)."""
    head = load_head(MODEL)
    output = await on_compute_thread(shard.runner.forward, runner_session(hop), head.embed(PROMPT[start:]), start,
                                     "prefill")
    return output[:, -1]


async def test_a_member_s_hops_attach_no_blocks_another_member_s_hops_kept(nats_server):
    mallory, victor = MemberKey.generate(), MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    roster = roster.with_member(new_member("mallory", "orchestrator", mallory.public_key, "trusted"))
    roster = roster.with_member(new_member("victor", "orchestrator", victor.public_key, "trusted"))
    async with tiny_shard_server(nats_server.url, prefix_ttl_s=600.0) as shard:
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")
        truth = await last_output(shard, open_hop("whole"), 0)
        for names in (VICTIM_NAMES, PUBLIC_NAMES):
            await keep_junk(shard, f"junk-{names.hashes[0][:8]}", names, mallory)
            victims_hop = open_hop(f"victim-{names.hashes[0][:8]}", names)
            opened = await ask(shard, victims_hop, victor)
            assert (opened.ok, opened.cached_tokens) == (True, 0)  # a miss: the victim prefills its whole prompt
            torch.testing.assert_close(await last_output(shard, victims_hop, 0), truth, rtol=0, atol=0)
            await close(shard, victims_hop, victor)
            # The keeper's own hops still find what they kept (it can mislead only its own calls).
            own_hop = open_hop(f"own-{names.hashes[0][:8]}", names)
            assert (await ask(shard, own_hop, mallory)).cached_tokens == 2 * BLOCK
            await close(shard, own_hop, mallory)

        # What the victim's own hop keeps, its next call attaches: each member prefills a public prompt once.
        kept_by_victim = open_hop("victim-turn-1")
        assert (await ask(shard, kept_by_victim, victor)).ok
        await last_output(shard, kept_by_victim, 0)
        await close(shard, kept_by_victim, victor, keep=PUBLIC_NAMES)
        next_turn = open_hop("victim-turn-2", PUBLIC_NAMES)
        assert (await ask(shard, next_turn, victor)).cached_tokens == 2 * BLOCK
        torch.testing.assert_close(await last_output(shard, next_turn, 2 * BLOCK), truth, rtol=1e-4, atol=1e-4)


async def test_on_an_open_mesh_any_hop_attaches_what_another_kept(nats_server):
    async with tiny_shard_server(nats_server.url, prefix_ttl_s=600.0) as shard:
        assert shard.server.open_verifier is None  # no roster: opens are not told apart
        first = open_hop("turn-1")
        assert (await ask(shard, first, None)).ok
        await last_output(shard, first, 0)
        await close(shard, first, None, keep=VICTIM_NAMES)
        assert (await ask(shard, open_hop("turn-2", VICTIM_NAMES), None)).cached_tokens == 2 * BLOCK
