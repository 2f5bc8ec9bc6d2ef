"""A shard host on a community mesh takes an `open`'s keys only sealed to its member key: one carrying them in clear
(which the broker and every subscriber to `>` have read) is refused `unauthorized`, as is one whose sealed keys another
member copied into an open of its own; a sealed open serves, and its orchestrator's owner proofs keep and close it
(hearth/services/transport/key_seal.py)."""

from __future__ import annotations

from datetime import datetime, timezone

from hearth.protocol.control import CloseHop, ControlReply, KeepHop, OpenHop, PrefixBlocks
from hearth.services.common.call_signing import CallVerifier
from hearth.services.orchestrator.hop_owner import open_message, open_signer, owner_key, proven
from hearth.trust.keys import MemberKey
from hearth.trust.roster import Roster, new_member
from tests.integration.tiny_shard_server import CONTEXT, tiny_shard_server

reply_timeout_s = 5.0
HOST = "tiny-host"


def open_hop(pipeline_id: str) -> OpenHop:
    return OpenHop(pipeline_id=pipeline_id, session_id="s1", hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=1, max_session_tokens=CONTEXT,
                   inbound_link_key=owner_key(pipeline_id, "in"), outbound_link_key=owner_key(pipeline_id, "out"),
                   notice_key=owner_key(pipeline_id, "notice"), owner_key=owner_key(pipeline_id, "tiny-0-1"),
                   seal_activations=True)


async def test_a_community_host_takes_an_opens_keys_only_sealed_to_its_member_key(nats_server):
    host, orchestrator, other = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
    roster = Roster(community="t", created_at=datetime.now(timezone.utc))
    roster = roster.with_member(new_member(HOST, "shard", host.public_key))
    roster = roster.with_member(new_member("orch", "orchestrator", orchestrator.public_key, "trusted"))
    roster = roster.with_member(new_member("other", "orchestrator", other.public_key, "trusted"))
    sign, sign_other = (open_signer(key, {HOST: host.public_key}.get) for key in (orchestrator, other))
    async with tiny_shard_server(nats_server.url) as shard:
        # As a host with a member key and the community's roster has them (hearth/services/common/event_trust.py).
        shard.server.signing_key = host
        shard.server.open_verifier = CallVerifier(roster, max_clock_skew_s=30, min_caller_trust="member")

        async def ask(body: bytes, headers: dict[str, str] | None = None) -> ControlReply:
            message = await shard.client.request(shard.subject, body, timeout=reply_timeout_s, headers=headers)
            return ControlReply.model_validate_json(message.data)

        # In clear, even signed by a member: refused.
        plain = open_hop("plain").model_dump_json().encode()
        refused = await ask(plain, sign(shard.subject, plain))
        assert (refused.ok, refused.code) == (False, "unauthorized") and "sealed" in refused.message
        assert shard.server.active_streams == 0

        # Sealed to the host and signed by the orchestrator that sealed them: served.
        body, headers = open_message(open_hop("sealed"), HOST, shard.subject, sign)
        assert (await ask(body, headers)).ok
        # Another member re-sending those sealed keys in an open it signs takes nothing over.
        copied = await ask(body, sign_other(shard.subject, body))
        assert (copied.ok, copied.code) == (False, "unauthorized")

        # Its owner proofs count; the same requests without one do not.
        keep = KeepHop(pipeline_id="sealed", session_id="s1", keep=PrefixBlocks(block_tokens=4, hashes=["0" * 32]))
        assert (await ask(keep.model_dump_json().encode())).code == "unknown_pipeline"
        assert (await ask(proven(keep, "tiny-0-1").model_dump_json().encode())).ok
        close = CloseHop(pipeline_id="sealed", session_id="s1")
        await ask(close.model_dump_json().encode())
        assert shard.server.active_streams == 1
        await ask(proven(close, "tiny-0-1").model_dump_json().encode())
        assert shard.server.active_streams == 0
