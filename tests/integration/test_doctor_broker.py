"""`hearth doctor` against a real community broker: a member's key is admitted, the event streams its role waits for
are there and its clock is within the broker's; a key the broker does not know is refused, and the checks that need
the login are skipped saying so; a caller's `hearth doctor` passes and says whether an orchestrator answers; a TLS
broker whose certificate another CA signed fails the login saying which setting to fix."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.tls import write_throwaway_ca
from hearth.services.cli import app
from hearth.services.doctor.command import run_checks
from hearth.trust.community import Community
from tests.community_log import community_on_a_broker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def community_broker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doctor")
    with community_on_a_broker(folder, (("kitchen", "shard"), ("hub", "orchestrator"), ("alice", "client"))) \
            as (community, server):
        yield community, server


def broker_verdicts(community_folder, url: str, role: str, name: str) -> dict[str, tuple[str, str]]:
    checks = run_checks(None, role, name=name, model=None, memory_budget_mb=None, device=None, dtype=None,
                        quantize=None, nats_url=url, creds=None, insecure=False, community=community_folder)
    return {check.check: (check.verdict, check.detail) for check in checks}


@pytest.mark.parametrize("role,name,streams", [("host", "kitchen", "HEARTH_SHARDS exist"),
                                               ("orchestrator", "hub", "KV_hearth-call-nonces exist")])
def test_a_members_key_is_admitted_and_its_role_finds_the_streams_and_the_brokers_time(community_broker, role, name,
                                                                                       streams):
    community, server = community_broker
    found = broker_verdicts(community.directory, server.url, role, name)
    assert found["member"][0] == "ok"
    assert found["broker"] == ("ok", found["broker"][1]) and f"as {name} (nats-server 2." in found["broker"][1]
    assert found["streams"][0] == "ok" and streams in found["streams"][1]
    assert found["clock"][0] == "ok" and "of the broker's (at most 30 s allowed)" in found["clock"][1]


def test_a_key_the_broker_does_not_know_is_refused_and_the_rest_skipped(community_broker, tmp_path):
    _community, server = community_broker
    elsewhere = Community.init(tmp_path / "elsewhere", "oak-lane")
    elsewhere.add("kitchen", "shard")
    found = broker_verdicts(elsewhere.directory, server.url, "shard", "kitchen")
    assert found["member"][0] == "ok"  # its own roster names it: only the broker does not
    assert found["broker"][0] == "fail" and "refused this member's key (authorization violation)" in found["broker"][1]
    assert found["streams"] == ("skip", "the broker refused the login")
    assert found["clock"] == ("skip", "the broker refused the login")


def test_a_callers_doctor_passes_and_says_no_orchestrator_answers(community_broker):
    community, server = community_broker
    result = CliRunner().invoke(app, ["doctor", "--role", "client", "--community", str(community.directory),
                                      "--name", "alice", "--nats", server.url, "--json"])
    assert result.exit_code == 0, result.output
    checks = {check["check"]: check for check in json.loads(result.output)["checks"]}
    assert checks["broker"]["verdict"] == "ok" and checks["clock"]["verdict"] == "skip"
    assert checks["orchestrators"]["verdict"] == "warn" and "llm.models" in checks["orchestrators"]["detail"]


def test_a_tls_broker_whose_certificate_another_ca_signed_fails_the_login_naming_the_ca_setting(tmp_path,
                                                                                                   monkeypatch):
    brokers = write_throwaway_ca(tmp_path / "broker-ca")
    ours = write_throwaway_ca(tmp_path / "our-ca", validity_days=365)
    monkeypatch.setenv("HEARTH_NATS__TLS_CA_FILE", str(ours.ca_file))
    monkeypatch.setenv("HEARTH_NATS__CONNECT_TIMEOUT_S", "1")
    with EmbeddedNatsServer(store_dir=tmp_path / "nats", tls_block=brokers.server_block()) as server:
        checks = {check.check: check for check in run_checks(
            None, "client", name=None, model=None, memory_budget_mb=None, device=None, dtype=None, quantize=None,
            nats_url=server.url, creds=None, insecure=True, community=None)}
    assert checks["tls"].verdict == "ok"  # the files load: only the broker shows they are not its CA's
    assert checks["broker"].verdict == "fail" and "its TLS handshake failed" in checks["broker"].detail
    assert "tls_ca_file" in checks["broker"].fix
