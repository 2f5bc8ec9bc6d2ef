"""Shards and orchestrators of different hearth versions on one mesh (hearth/protocol/mesh_protocol.py): an
orchestrator leaves a shard of another mesh protocol out of its chains and a shard refuses such an orchestrator's
open, each in one line naming both versions. The old messages are as a hearth from before protocol versions (commit
d0065f3) wrote them: tests/data/before_protocol_versions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy.orm import sessionmaker

from hearth.events.models import ShardAdvertised
from hearth.protocol.control import ControlReply, OpenHop
from hearth.protocol.mesh_protocol import MESH_PROTOCOL, mesh_protocol_refusal
from hearth.readmodels.batch_rows import epoch_s
from hearth.services.common.call_signing import CallRefused
from hearth.services.orchestrator.router import RoutingError, ShardRouter
from hearth.services.shard.open_check import checked_open, open_of_another_version
from tests.readmodel_helpers import MODEL_ID, T0, WEIGHTS_SHA, LogBuilder, advertised, apply_all, at, migrated_engine

RECORDED = Path(__file__).resolve().parents[1] / "data" / "before_protocol_versions"


def old_advert(node: str) -> ShardAdvertised:
    """A whole-model shard's advert as a hearth from before protocol versions published it, of the helpers' model."""
    recorded = ShardAdvertised.model_validate_json((RECORDED / "shard_advertised.json").read_text())
    return ShardAdvertised.model_validate({**recorded.model_dump(), "model_id": MODEL_ID, "weights_sha256": WEIGHTS_SHA,
                                           "node_id": node, "shard_id": f"{MODEL_ID}:0-5@{node}",
                                           "occurred_at": at(1.0), "total_layers": 6})


@pytest.fixture
def router_over(tmp_path):
    engine = migrated_engine(tmp_path / "router.db")
    log = LogBuilder()

    def plan(*adverts: ShardAdvertised) -> list[str]:
        apply_all(engine, [log.stored(advert) for advert in adverts])
        now = epoch_s(T0) + 5.0
        router = ShardRouter(sessionmaker(engine), health_timeout_s=30.0, allow_self_as_shard=False,
                             self_node_id="hub", clock=lambda: now)
        return [hop.shard_id for hop in router.plan(router.candidates(MODEL_ID), MODEL_ID, WEIGHTS_SHA, now=now)]

    yield plan
    engine.dispose()


def test_a_shard_of_a_hearth_from_before_protocol_versions_is_left_out_in_one_line_naming_both(router_over):
    with pytest.raises(RoutingError) as refused:
        router_over(old_advert("attic"))
    assert refused.value.code == "shard_unavailable"
    message = str(refused.value)
    assert f"{MODEL_ID}:0-5@attic: it speaks hearth mesh protocol 1 (a hearth from before protocol versions), " \
           f"this one {MESH_PROTOCOL}: a mesh runs one version, upgrade it" in message
    assert "\n" not in message


def test_a_replica_of_this_version_serves_while_the_old_one_is_left_out(router_over):
    current = advertised(0, 5, "kitchen", total=6)
    assert current.protocol == MESH_PROTOCOL
    assert router_over(old_advert("attic"), current) == [current.shard_id]


def control_message(request: OpenHop) -> SimpleNamespace:
    return SimpleNamespace(subject="hearth.ctl.attic.x", data=request.model_dump_json().encode(), headers=None)


class RefusesEveryOpen:
    """An open verifier of a community mesh for which no open is signed (an older orchestrator signs none)."""

    def check(self, *_args):
        return CallRefused("unsigned", "no signature")


def test_an_open_from_an_orchestrator_from_before_protocol_versions_is_refused_naming_both():
    request = OpenHop.model_validate_json((RECORDED / "open.json").read_text())
    reply = checked_open(control_message(request), request, RefusesEveryOpen(), None)
    # bad_request: a code every hearth's orchestrator reads (an older one could not parse `unauthorized`).
    assert isinstance(reply, ControlReply) and reply.code == "bad_request"
    assert reply.message == (f"the orchestrator speaks hearth mesh protocol 1 (a hearth from before protocol "
                             f"versions), this one {MESH_PROTOCOL}: a mesh runs one version, upgrade the orchestrator")


def test_an_open_of_this_version_passes_the_version_check():
    request = OpenHop.model_validate_json((RECORDED / "open.json").read_text()).model_copy(
        update={"protocol": MESH_PROTOCOL})
    assert checked_open(control_message(request), request, None, None) == (None, None, request)


def test_a_newer_peer_is_refused_asking_to_upgrade_this_one():
    assert mesh_protocol_refusal(MESH_PROTOCOL, "it") is None
    assert mesh_protocol_refusal(MESH_PROTOCOL + 1, "it") == (
        f"it speaks hearth mesh protocol {MESH_PROTOCOL + 1}, this one {MESH_PROTOCOL}: a mesh runs one version, "
        f"upgrade this one")


@pytest.mark.parametrize("body, told", [
    ({"op": "open", "protocol": MESH_PROTOCOL + 1, "a_newer_field": 1}, MESH_PROTOCOL + 1),
    ({"op": "open", "a_field_since_removed": 1}, None),
    ({"op": "open", "protocol": MESH_PROTOCOL, "a_field_nobody_sends": 1}, "not refused for its version"),
    ({"op": "open", "protocol": 2**80}, "not refused for its version"),
    ({"op": "open", "protocol": True}, "not refused for its version"),
    ({"op": "stat", "protocol": MESH_PROTOCOL + 1}, "not refused for its version"),
])
def test_an_open_that_does_not_validate_is_refused_for_its_version_only_when_it_names_another(body, told):
    reply = open_of_another_version(json.dumps(body).encode())
    if told == "not refused for its version":
        assert reply is None  # its validation error says what is wrong
    else:
        assert (reply.code, reply.message) == ("bad_request", mesh_protocol_refusal(told, "the orchestrator"))
