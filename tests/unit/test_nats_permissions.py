"""Each role's broker permissions (hearth/services/broker/permissions.py): the JetStream API verbs it needs and no
other, no administration of a stream by anyone but `system`, and orchestrator frames only into callers' inboxes."""

from __future__ import annotations

import pytest

from hearth.events.streams import ALL_STREAMS, PIPELINES_STREAM, SHARDS_STREAM
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, ORCHESTRATOR_REQUEST_WILDCARD, orchestrator_request_subject
from hearth.services.broker.permissions import (
    is_member_inbox,
    reply_allowed,
    role_permissions,
)

ROLES = ("shard", "orchestrator", "projector", "auditor", "client")
READS = {"shard": (SHARDS_STREAM,), "orchestrator": ALL_STREAMS, "projector": ALL_STREAMS, "auditor": ALL_STREAMS,
         "client": ()}
ADMIN_VERBS = ("STREAM.CREATE.{s}", "STREAM.UPDATE.{s}", "STREAM.DELETE.{s}", "STREAM.PURGE.{s}",
               "STREAM.MSG.DELETE.{s}", "STREAM.MSG.GET.{s}", "DIRECT.GET.{s}", "STREAM.SNAPSHOT.{s}",
               "STREAM.RESTORE.{s}", "CONSUMER.DURABLE.CREATE.{s}.d", "CONSUMER.CREATE.{s}", "CONSUMER.PAUSE.{s}.c",
               "CONSUMER.MSG.NEXT.{s}.c", "STREAM.LEADER.STEPDOWN.{s}", "STREAM.PEER.REMOVE.{s}")


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    pattern_tokens, subject_tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > index
        if index >= len(subject_tokens) or token not in ("*", subject_tokens[index]):
            return False
    return len(pattern_tokens) == len(subject_tokens)


def may_publish(role: str, subject: str, callers=("_INBOX.alice",)) -> bool:
    return any(matches(pattern, subject) for pattern in role_permissions(role, "m", callers).publish)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("stream", ALL_STREAMS)
def test_no_role_but_system_administers_a_stream(role, stream):
    for verb in ADMIN_VERBS:
        assert not may_publish(role, f"$JS.API.{verb.format(s=stream)}"), verb
    assert not may_publish(role, "$JS.API.ACCOUNT.PURGE.x") and not may_publish(role, "$JS.API.META.LEADER.STEPDOWN")
    assert may_publish("system", f"$JS.API.STREAM.DELETE.{stream}")


@pytest.mark.parametrize("role", ROLES)
def test_each_role_reads_only_the_streams_it_needs_through_consumers_of_its_own(role):
    for stream in ALL_STREAMS:
        reads = stream in READS[role]
        for subject in (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.hearth-read-1",
                        f"$JS.API.CONSUMER.CREATE.{stream}.hearth-read-1.hearth.events.>",
                        f"$JS.API.CONSUMER.DELETE.{stream}.hearth-read-1", f"$JS.FC.{stream}.c.1.2.3"):
            assert may_publish(role, subject) == reads, (subject, reads)


def test_orchestrator_frames_go_only_to_callers_inboxes():
    assert may_publish("orchestrator", "_INBOX.alice.abc")
    for subject in ("_INBOX.shard-a.abc", "_INBOX.projector.abc", "$JS.API.STREAM.INFO.X"):
        assert not may_publish("orchestrator", subject), subject
    assert not role_permissions("orchestrator", "o", ("_INBOX.alice",)).allow_responses


def test_replies_go_only_to_a_caller_s_inbox():
    assert is_member_inbox("_INBOX.bob.x") and not is_member_inbox("_INBOX.bob") and not is_member_inbox("a.b.c")
    roles = {"alice": "client", "steward": "system", "shard-a": "shard", "orch": "orchestrator"}.get
    assert reply_allowed("_INBOX.alice.x", roles) and reply_allowed("_INBOX.steward.x", roles)
    for reply in ("_INBOX.shard-a.x", "_INBOX.orch.x", "_INBOX.nobody.x", "_INBOX.alice", "_INBOX.alice.*",
                  "hearth.events.pipeline.p.completed", f"$JS.API.STREAM.INFO.{PIPELINES_STREAM}"):
        assert not reply_allowed(reply, roles), reply
    assert reply_allowed("_INBOX.Zx9") and not reply_allowed("hearth.events.shard.n.k.heartbeat")


def may_subscribe(role: str, subject: str, name: str = "m") -> bool:
    return any(matches(pattern, subject) for pattern in role_permissions(role, name, ("_INBOX.alice",)).subscribe)


def test_an_orchestrator_hears_the_queue_and_its_own_subject_only_and_a_client_may_call_any():
    own, another = orchestrator_request_subject("orch-a"), orchestrator_request_subject("orch-b")
    assert may_subscribe("orchestrator", CHAT_REQUEST_SUBJECT, "orch-a")
    assert may_subscribe("orchestrator", own, "orch-a") and not may_subscribe("orchestrator", another, "orch-a")
    assert not may_subscribe("orchestrator", ORCHESTRATOR_REQUEST_WILDCARD, "orch-a")
    for subject in (CHAT_REQUEST_SUBJECT, own, another):
        assert may_publish("client", subject), subject
        assert not may_subscribe("client", subject), subject
    # One token under the queue's subject, nothing deeper.
    assert not may_publish("client", f"{own}.x")


def test_no_role_but_system_is_granted_responses_and_a_shard_answers_only_askers_and_itself():
    """A response permission lets a member that hears its own publishes (a host's control and activation subjects)
    grant itself any subject: only `system`, which may publish anywhere anyway, has one."""
    for role in ROLES:
        assert not role_permissions(role, "m", ("_INBOX.alice",), ("_INBOX.orch",)).allow_responses, role
    shard = role_permissions("shard", "shard-a", ("_INBOX.alice",), ("_INBOX.orch", "_INBOX.steward"))

    def shard_may_publish(subject: str) -> bool:
        return any(matches(pattern, subject) for pattern in shard.publish)

    for inbox in ("_INBOX.orch.x.1", "_INBOX.steward.x", "_INBOX.shard-a.x"):
        assert shard_may_publish(inbox), inbox
    for inbox in ("_INBOX.alice.x", "_INBOX.shard-b.x", "_INBOX.orch"):
        assert not shard_may_publish(inbox), inbox
