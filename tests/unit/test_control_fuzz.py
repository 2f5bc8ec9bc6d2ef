"""A shard's control subject as a hostile member writes to it (hypothesis): any body is decoded into a control request
or refused as `bad_request` in one line naming the fields (never raising, never echoing a line break or an escape
sequence of the sender's); an `open` with any `sealed_keys` opens or is refused; any signing headers verify or are
refused; and an orchestrator reads any answer of a shard as a ControlReply, a ShardStat or no answer."""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hearth.protocol.bounds import max_reason_chars
from hearth.protocol.control import CloseHop, ControlReply, KeepHop, OpenHop, StatShard, reply_says_ok
from hearth.services.common.call_signing import (
    HEADER_CALLER, HEADER_CALLER_NONCE, HEADER_CALLER_SIGNATURE, HEADER_CALLER_TIME, CallRefused, CallVerifier,
    signed_call_headers,
)
from hearth.services.common.config import TransportSettings
from hearth.services.orchestrator.chain import HopChain
from hearth.services.orchestrator.router import Hop
from hearth.services.shard.open_check import decoded_control_request
from hearth.services.transport.key_seal import keys_for_host, seal_hop_keys
from hearth.trust.keys import MemberKey, sealed_to
from hearth.trust.roster import Member, new_member, new_roster
from tests.hostile_json import hostile_body, odd_text, one_showable_line

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LINK_KEY = "A" * 43 + "="
BLOCKS = {"block_tokens": 16, "hashes": ["0" * 32, "f" * 32]}
OPEN = {"op": "open", "pipeline_id": "p-1", "session_id": "s-1", "hop": 0, "hop_count": 2, "model_id": "tiny",
        "weights_sha256": "0" * 64, "quantization": "none", "layer_lo": 0, "layer_hi": 1, "wire_dtype": "int8",
        "max_session_tokens": 100, "upstream_node": "hub", "downstream_node": "node1", "inbound_link_key": LINK_KEY,
        "outbound_link_key": LINK_KEY, "notice_key": LINK_KEY, "owner_key": LINK_KEY, "seal_activations": True,
        "prefix": BLOCKS, "protocol": 2}
CONTROL_REQUESTS = [OPEN, {"op": "close", "pipeline_id": "p-1", "session_id": "s-1", "owner_proof": "0" * 64,
                           "keep": BLOCKS},
                    {"op": "keep", "pipeline_id": "p-1", "session_id": "s-1", "owner_key": LINK_KEY, "keep": BLOCKS},
                    {"op": "stat", "claim": "0" * 32, "claimed_at_ns": 5}]

@FUZZ
@given(body=hostile_body(CONTROL_REQUESTS, deep_field="prefix"))
@example(body=b'{"op":"close","pipeline_id":"p-1","keep":{"\\n\\u001b[2J":1}}')
@example(body=b'{"op":"stat\\n\\u202e"}')
def test_any_control_body_is_a_request_or_a_one_line_bad_request(body):
    decoded = decoded_control_request(body)
    if isinstance(decoded, ControlReply):
        assert not decoded.ok and decoded.code == "bad_request"
        assert decoded.message and len(decoded.message) <= max_reason_chars
        assert one_showable_line(decoded.message), decoded.message
    else:
        assert isinstance(decoded, (OpenHop, CloseHop, KeepHop, StatShard))
        decoded.model_dump_json()


HOST = MemberKey.generate()
OPENER = MemberKey.generate()


def _sealed(payload: bytes) -> str:
    return base64.urlsafe_b64encode(sealed_to(HOST.public_key, payload)).decode()


KEYS_JSON = {"opener": OPENER.public_key, "pipeline_id": "p-1", "session_id": "s-1", "hop": 0,
             "inbound_link_key": LINK_KEY, "outbound_link_key": LINK_KEY, "notice_key": LINK_KEY,
             "owner_key": LINK_KEY}
sealed_keys = st.one_of(
    st.binary(min_size=1, max_size=600).map(lambda raw: base64.urlsafe_b64encode(raw).decode()),
    st.binary(max_size=200).map(_sealed),  # sealed to the host, but no HopKeys inside
    st.dictionaries(st.sampled_from(sorted(KEYS_JSON)), st.one_of(odd_text, st.integers(-(2**70), 2**70)),
                    max_size=3).map(lambda changed: _sealed(json.dumps({**KEYS_JSON, **changed}).encode())),
)


@FUZZ
@given(sealed=sealed_keys)
def test_an_open_with_any_sealed_keys_opens_or_is_refused(sealed):
    request = OpenHop(**{name: value for name, value in OPEN.items()
                         if name not in ("op", "inbound_link_key", "outbound_link_key", "notice_key", "owner_key")},
                      sealed_keys=sealed[:2048].rstrip("=") or "A")
    opened = keys_for_host(request, HOST, OPENER.public_key)
    assert isinstance(opened, (OpenHop, str))
    honest = seal_hop_keys(request.model_copy(update={"sealed_keys": None, **dict.fromkeys(
        ("inbound_link_key", "outbound_link_key", "notice_key", "owner_key"), LINK_KEY)}), HOST.public_key,
        OPENER.public_key)
    assert isinstance(keys_for_host(honest, HOST, OPENER.public_key), OpenHop)


VERIFIER = CallVerifier(new_roster("test").with_member(new_member("hub", "orchestrator", OPENER.public_key)),
                        max_clock_skew_s=30.0, min_caller_trust="member", signed="open", receiver="shard")
SIGNED = signed_call_headers(OPENER, "hearth.ctl.node0.x", "", b"{}", now_s=1000.0)
header_values = st.one_of(st.sampled_from(list(SIGNED.values())), odd_text, st.text(max_size=200),
                          st.sampled_from(["nan", "inf", "1e400", "-1", "9" * 13, "0" * 32 + "\n", "=" * 88]))


@FUZZ
@given(changed=st.dictionaries(st.sampled_from([HEADER_CALLER, HEADER_CALLER_TIME, HEADER_CALLER_NONCE,
                                                HEADER_CALLER_SIGNATURE, "Other"]), header_values, max_size=3),
       body=st.sampled_from([b"{}", b"{ }", b""]))
def test_any_signing_headers_of_an_open_verify_or_are_refused(changed, body):
    checked = VERIFIER.check("hearth.ctl.node0.x", "", body, {**SIGNED, **changed}, now_s=1000.0)
    assert isinstance(checked, (Member, CallRefused))


SHARD_ANSWERS = [{"ok": True, "code": None, "message": "", "shard_id": "tiny-0-1", "cached_tokens": 3,
                  "replay_steps": True},
                 {"shard_id": "tiny-0-1", "active_streams": 1, "open_pipelines": ["p-1"], "cached_sessions": 1,
                  "cache_bytes": 10, "claimed": {"at_ns": 5, "nonce": "0" * 32}}]


class _AnsweringShard:
    """Just enough of a NATS client to build a chain and answer its `open` with `answer`."""

    max_payload = 2**20
    answer = b""

    async def request(self, subject: str, data: bytes, timeout: float, headers=None) -> SimpleNamespace:
        return SimpleNamespace(data=self.answer)


SHARD = _AnsweringShard()
HOP = Hop("m:0-1@n0", "hearth.ctl.n0.x", "n0", 0, 1)
CHAIN = HopChain(SHARD, "p-1", [HOP], node_id="orch", model_id="m", weights_sha256="w",  # type: ignore[arg-type]
                 transport=TransportSettings())


@FUZZ
@given(answer=hostile_body(SHARD_ANSWERS, deep_field="message"))
@example(answer=b'{"ok": "\n"}')
def test_an_orchestrator_reads_any_answer_of_a_shard_as_a_reply_or_as_no(answer):
    assert reply_says_ok(answer) in (True, False)
    try:
        answered = ControlReply.model_validate_json(answer)
    except ValidationError:
        answered = None
    SHARD.answer = answer
    reply = asyncio.run(CHAIN._open_hop(0, HOP))
    if answered is not None:
        assert reply == answered
    else:  # an answer that is none refuses the open, in one line
        assert not reply.ok and one_showable_line(reply.message) and "ControlReply" in reply.message, reply
