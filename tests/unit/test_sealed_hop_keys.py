"""On a community mesh no key a hop is opened with is readable on the wire: an `open` carries its link, notice and owner
keys sealed to the host member's key (whoever runs the broker, or a steward's `system` role subscribed to `>`, sees only
ciphertext), the host recovers them, and a `close` or `keep` proves ownership without carrying the owner key
(hearth/services/transport/key_seal.py)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import pytest

from hearth.protocol.control import CloseHop, ControlReply, KeepHop, OpenHop, PrefixBlocks
from hearth.services.common.call_signing import HEADER_CALLER
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.hop_owner import open_signer, owner_key, proven
from hearth.services.orchestrator.router import Hop
from hearth.services.transport.key_seal import keys_for_host, proves_owner
from hearth.services.transport.mac import decode_link_key
from hearth.trust.keys import MemberKey

PIPELINE = "pipe-sealed"
HOST_NODE = "hearth-host"
HOP = Hop(shard_id="tiny-0-1", control_subject=f"hearth.ctl.{HOST_NODE}.tiny", node_id=HOST_NODE,
          layer_lo_to_run=0, layer_hi_to_run=1)


class WireTap:
    """A stand-in for the broker connection that keeps every message as a subscriber to `>` would see it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, dict[str, str]]] = []
        self.stats, self.max_payload = {"reconnects": 0}, None

    async def request(self, subject: str, body: bytes, timeout: float, headers: dict[str, str] | None = None):
        self.seen.append((subject, body, headers or {}))
        return SimpleNamespace(data=ControlReply(ok=True).model_dump_json().encode())

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.seen.append((subject, body, headers or {}))

    async def flush(self, timeout: float = 0) -> None:
        return None


def encodings(key: bytes) -> list[bytes]:
    """Every form a key takes in this repo (and the obvious others): raw, urlsafe and standard base64, hex."""
    forms = [key, base64.urlsafe_b64encode(key), base64.b64encode(key), key.hex().encode(), key.hex().upper().encode()]
    return forms + [form.rstrip(b"=") for form in forms]


def chain_on(tap: WireTap, orchestrator: MemberKey, members: dict[str, str]) -> HopChain:
    return HopChain(tap, PIPELINE, [HOP], node_id="orch-node", model_id="tiny", weights_sha256="0" * 64,
                    transport=TransportSettings(), sign_open=open_signer(orchestrator, members.get))


async def test_a_community_open_shows_the_broker_no_key_and_the_host_recovers_them():
    orchestrator, host, steward = MemberKey.generate(), MemberKey.generate(), MemberKey.generate()
    tap = WireTap()
    chain = chain_on(tap, orchestrator, {HOST_NODE: host.public_key})
    assert (await chain._open_hop(0, HOP)).ok
    [(subject, body, headers)] = tap.seen
    real_keys = [chain.link_keys[0], chain.link_keys[1], chain.notice_keys[0],
                 decode_link_key(owner_key(PIPELINE, HOP.shard_id))]
    wire = body + json.dumps(headers).encode()
    for key in real_keys:
        for form in encodings(key):
            assert form not in wire
    fields = json.loads(body)
    assert [fields[name] for name in ("inbound_link_key", "outbound_link_key", "notice_key", "owner_key")] == [None] * 4
    assert fields["sealed_keys"] and fields["seal_activations"] is True

    # The host's member key opens them; nobody else's does (the steward's `system` key neither).
    seen = OpenHop.model_validate_json(body)
    opened = keys_for_host(seen, host, headers[HEADER_CALLER])
    assert isinstance(opened, OpenHop)
    assert [decode_link_key(key) for key in opened.plain_keys()] == real_keys
    assert opened.sealed_keys is None and opened.seal_activations
    assert isinstance(keys_for_host(seen, steward, headers[HEADER_CALLER]), str)
    # Bound to the open: copied into another member's open, or to another session of the pipeline, they do not count.
    assert "another open" in keys_for_host(seen, host, steward.public_key)
    assert "another open" in keys_for_host(seen.model_copy(update={"session_id": "other"}), host,
                                           headers[HEADER_CALLER])

    # Its close and keep prove ownership without the key.
    await chain.keep_now(PrefixBlocks(block_tokens=4, hashes=["0" * 32]))
    chain._open_sent = True  # as open() marks it (its subscriptions are not this test's)
    await chain.close()
    later = [body for _, body, _ in tap.seen[1:]]
    assert later and all(form not in body for body in later for form in encodings(real_keys[3]))
    keep = KeepHop.model_validate_json(later[0])
    close = CloseHop.model_validate_json(later[-1])
    assert proves_owner(keep, opened.owner_key) and proves_owner(close, opened.owner_key)


def test_an_owner_proof_counts_only_for_its_own_request_and_key():
    key, other = owner_key(PIPELINE, "a"), owner_key(PIPELINE, "b")
    close = proven(CloseHop(pipeline_id=PIPELINE, session_id="s1"), "a")
    assert close.owner_key is None and proves_owner(close, key)
    assert not proves_owner(close, other)
    # Moved to another session (a failover's successor) or stripped of its session, the proof does not count.
    assert not proves_owner(close.model_copy(update={"session_id": "s2"}), key)
    assert not proves_owner(proven(CloseHop(pipeline_id=PIPELINE), "a"), key)
    assert not proves_owner(CloseHop(pipeline_id=PIPELINE, session_id="s1"), key)


async def test_an_open_to_a_host_the_roster_does_not_know_is_never_sent():
    tap = WireTap()
    reply = await chain_on(tap, MemberKey.generate(), {})._open_hop(0, HOP)
    assert (reply.ok, reply.code) == (False, "unauthorized") and not tap.seen


def test_a_community_host_refuses_plain_keys_and_an_open_mesh_host_sealed_ones():
    host = MemberKey.generate()
    plain = OpenHop(pipeline_id=PIPELINE, session_id="s", hop=0, hop_count=1, model_id="tiny", weights_sha256="0" * 64,
                    layer_lo=0, layer_hi=1, owner_key=owner_key(PIPELINE, "a"))
    assert "never in clear" in keys_for_host(plain, host, None)
    assert keys_for_host(plain, None, None) == plain  # an open mesh: as before
    sealed = open_signer(MemberKey.generate(), {HOST_NODE: host.public_key}.get).sealed(plain, HOST_NODE)
    assert isinstance(keys_for_host(sealed, None, None), str)
    with pytest.raises(ValueError):  # both at once is no open at all
        OpenHop.model_validate({**sealed.model_dump(), "notice_key": plain.owner_key})
