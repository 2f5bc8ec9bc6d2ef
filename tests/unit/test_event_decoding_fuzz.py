"""Events as a hostile member stores them (hypothesis), signed with its own key or not: any body decodes into an event
or is refused with a ValueError (decode_event's documented refusal); a reader makes each stored message a StoredEvent
or a SkippedMessage whose texts encode, and a projection (open mesh or community) applies, rejects or skips every one
without raising, so no message can stall the read models (a poison message); hearth-replay shows each in a line that
encodes; and the signature check of a body nested to any depth the decoder takes answers without raising."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from hearth.events.consume import SkippedMessage, StoredEvent, decode_stored_message
from hearth.events.models import (
    IntegrityShardsVerified, KeptHop, KeptMark, KeptPrefix, PipelineCompleted, PipelineFailover, ShardVerification,
    ShardWithdrawn, decode_event, encode_event,
)
from hearth.events.signing import EventVerifier, StreamPosition, canonical_json, stored_canonical_bytes
from hearth.events.streams import PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import event_subject
from hearth.readmodels.projection import ReadModelProjection
from hearth.services.replay.render import jsonl_line, table_row
from tests.hostile_json import extreme_values, hostile_body, nested
from tests.readmodel_helpers import T0, at, constructed, heartbeat, migrated_engine
from tests.unit.test_event_signing import KEYS, community_roster, own_advertisement

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ADVERT = own_advertisement("host0")
KEPT = KeptPrefix(hops=[KeptHop(shard_id=ADVERT.shard_id, layer_lo=0, layer_hi=3)],
                  marks=[KeptMark(blocks=1, name="0" * 32)], idle_s=10)
EVENTS = [ADVERT, heartbeat(ADVERT.shard_id, node="host0"),
          ShardWithdrawn(node_id="host0", shard_id=ADVERT.shard_id, reason="bye", occurred_at=at(2)),
          constructed("p-1", [ADVERT.shard_id]).model_copy(update={"node_id": "hub"}),
          PipelineCompleted(pipeline_id="p-1", prompt_tokens=3, completion_tokens=4, duration_ms=5.0,
                            tokens_per_second=8.0, finish_reason="length", node_id="hub", occurred_at=at(3),
                            kept_prefix=KEPT, verification="met"),
          PipelineFailover(pipeline_id="p-1", failed_shard_id=ADVERT.shard_id, replacement_hops=[ADVERT.shard_id],
                           reason="x", resumed_at_token=2, node_id="hub", occurred_at=at(3)),
          IntegrityShardsVerified(pipeline_id="p-1", node_id="hub", occurred_at=at(3), shards=[
              ShardVerification(shard_id=ADVERT.shard_id, checks=1, verified_positions=3)])]
BODIES = [json.loads(encode_event(event)) for event in EVENTS]
# What a type only a newer hearth reads may be called: a projection keeps it as rejected, under that name.
_SURROGATE_TYPE = json.dumps({**BODIES[0], "type": "\ud800"}).encode()


@FUZZ
@given(body=hostile_body(BODIES, deep_field="hops"))
@example(body=b'{"type": [], "node_id": "n"}')
@example(body=b'{"type": "shard.heartbeat", "version": {}}')
@example(body=nested(100_000).encode())
def test_any_body_decodes_into_an_event_or_is_refused_with_a_value_error(body):
    try:
        decode_event(body)
    except ValueError:
        pass


@pytest.fixture(scope="module")
def read_model(tmp_path_factory):
    return migrated_engine(tmp_path_factory.mktemp("fuzz") / "rm.db")


def _signed(body: bytes, stream: str) -> bytes:
    """`body` signed as its stream's member would sign it (a member's own junk carries a good signature)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(document, dict):
        return body
    key = KEYS["host0" if stream == SHARDS_STREAM else "hub"]
    document["signer"] = key.public_key
    document["signature"] = key.sign_b64(canonical_json(document))
    return json.dumps(document).encode()


VERIFIER = EventVerifier(community_roster(), max_clock_skew_s=30.0)


@FUZZ
@given(body=hostile_body(BODIES, deep_field="hops", values=extreme_values), base=st.sampled_from(EVENTS),
       signed=st.booleans(),
       community=st.booleans())
@example(body=_SURROGATE_TYPE, base=ADVERT, signed=False, community=False)
def test_every_stored_message_is_applied_rejected_or_skipped_without_raising(read_model, body, base, signed,
                                                                             community):
    stream = SHARDS_STREAM if base.type.startswith("shard.") else PIPELINES_STREAM
    message = decode_stored_message(stream, 1, event_subject(base), T0, {}, _signed(body, stream) if signed else body)
    if isinstance(message, SkippedMessage):
        message.error.encode("utf-8")
        if message.newer is not None:
            message.newer.label.encode("utf-8")
    else:
        assert isinstance(message, StoredEvent)
        VERIFIER.rejection(message.event, received_at=message.time, stored_data=message.data,
                           position=StreamPosition(stream, message.seq, message.subject))
    table_row(message).encode("utf-8")
    jsonl_line(message).encode("utf-8")
    with Session(read_model) as session:
        session.begin()
        try:
            ReadModelProjection(verifier=VERIFIER if community else None).apply_many(session, [message])
        finally:
            session.rollback()


def test_the_signature_check_of_a_body_nested_to_any_depth_answers():
    """Whatever depth the stored body parses to, making its canonical bytes (one call deeper) never raises."""
    body = json.dumps(BODIES[0])[:-1]
    for depth in range(sys.getrecursionlimit() // 2, sys.getrecursionlimit()):
        canonical = stored_canonical_bytes(f'{body},"surprise":{nested(depth)}}}'.encode())
        assert canonical is None or canonical.endswith(b"}")
