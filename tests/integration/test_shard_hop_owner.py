"""Another member cannot end, copy, take over or share a call's hop on a shard by naming its pipeline and session ids
(they travel in plain headers, and `stat` lists open pipelines): a `close`, `keep` or re-open counts only with the
open's owner key, and an `open` of another pipeline naming the same session id gets a session of its own
(hearth/services/shard/server.py, hearth/services/orchestrator/hop_owner.py)."""

from __future__ import annotations

import torch

from hearth.inference.compute_thread import on_compute_thread
from hearth.protocol.control import CloseHop, ControlReply, KeepHop, OpenHop, PrefixBlocks, ShardStat, StatShard
from hearth.services.orchestrator.hop_owner import owner_key
from hearth.services.shard.compute import runner_session
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
SESSION = "victim-session"


def open_hop(pipeline_id: str, key: str | None) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id=SESSION, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, owner_key=key, max_session_tokens=CONTEXT)


async def test_only_the_opener_closes_keeps_or_reopens_a_hop_and_a_shared_session_id_shares_nothing(nats_server):
    async with tiny_shard_server(nats_server.url) as shard:
        runner = shard.runner

        async def ask(request) -> ControlReply:
            reply = await shard.client.request(shard.subject, request.model_dump_json().encode(),
                                               timeout=reply_timeout_s)
            return ControlReply.model_validate_json(reply.data)

        async def open_pipelines() -> list[str]:
            reply = await shard.client.request(shard.subject, StatShard().model_dump_json().encode(),
                                               timeout=reply_timeout_s)
            return ShardStat.model_validate_json(reply.data).open_pipelines

        victim_key = owner_key("pipeline-victim", "tiny-0-1")
        victim, attacker = open_hop("pipeline-victim", victim_key), open_hop("pipeline-other", None)
        # Another orchestrator's key, and the key this orchestrator gives another shard of the same pipeline.
        wrong_keys = (owner_key("pipeline-other", "tiny-0-1"), owner_key("pipeline-victim", "tiny-2-3"))
        assert (await ask(victim)).ok
        # The victim's session holds a prompt's KV (as after its prefill).
        hidden = torch.randn(1, 4, runner.info.hidden_size)
        await on_compute_thread(runner.forward, runner_session(victim), hidden, 0, "prefill")

        # Another orchestrator opens its own pipeline naming the victim's session id, then closes it: the victim's
        # KV is neither its session nor freed with it.
        assert (await ask(attacker)).ok
        assert (await ask(CloseHop(pipeline_id="pipeline-other", session_id=SESSION))).ok
        assert runner_session(victim) in runner.session_ids()

        # Closing, copying or re-opening the victim's hop without its owner key changes nothing.
        for forged_key in (None, *wrong_keys):
            await ask(CloseHop(pipeline_id="pipeline-victim", owner_key=forged_key))
            await ask(CloseHop(pipeline_id="pipeline-victim", session_id=SESSION, owner_key=forged_key))
            keep = KeepHop(pipeline_id="pipeline-victim", session_id=SESSION, owner_key=forged_key,
                           keep=PrefixBlocks(block_tokens=2, hashes=["0" * 32, "1" * 32]))
            assert (await ask(keep)).code == "unknown_pipeline"
            taken = await ask(victim.model_copy(update={"owner_key": forged_key}))
            assert (taken.ok, taken.code) == (False, "pipeline_taken"), taken
            assert await open_pipelines() == ["pipeline-victim"]
            assert runner_session(victim) in runner.session_ids()

        # Its own orchestrator re-opens it (a failover's new session) and closes it.
        assert (await ask(victim.model_copy(update={"session_id": "victim-session-2"}))).ok
        assert (await ask(CloseHop(pipeline_id="pipeline-victim", owner_key=victim_key))).ok
        assert await open_pipelines() == []
