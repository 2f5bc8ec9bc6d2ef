"""`hearth doctor`'s checks that need no broker: the member key and roster copy (the member's name, role and trust),
the TLS files, the free disk where hearth keeps state, the gateway's API keys and the configuration, each verdict
from real files in a test folder; and the report's lines and exit code."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from hearth.services.broker.tls import write_throwaway_ca
from hearth.services.common.config import HearthSettings, NatsSettings
from hearth.services.doctor.command import configuration_check
from hearth.services.doctor.report import DoctorReport, fail, ok, skip, warn
from hearth.services.doctor.setup_checks import (
    api_keys_check,
    disk_checks,
    key_file_for,
    low_disk_fail_bytes,
    low_disk_warn_bytes,
    member_checks,
    certificate_dates_check,
    tls_check,
)
from hearth.services.gateway.keys import create_api_key
from hearth.trust.community import Community

GiB = 1024 ** 3


@pytest.fixture
def community(tmp_path) -> Community:
    community = Community.init(tmp_path / "community", "elm-street")
    for name, role in (("alice", "client"), ("kitchen", "shard"), ("hub", "orchestrator")):
        community.add(name, role)
    community.add("lodger", "shard", trust="member")
    return community


def key_of(community: Community, name: str) -> Path:
    return community.directory / "keys" / f"{name}.nk"


def verdicts(checks) -> dict[str, str]:
    return {check.check: check.verdict for check in checks}


def test_a_members_own_key_and_role_pass(community):
    checks, setup = member_checks(NatsSettings(creds_file=key_of(community, "kitchen")), "host", "kitchen")
    assert verdicts(checks) == {"key": "ok", "roster": "ok", "member": "ok"}
    assert setup.may_connect and setup.fits_role and setup.name == "kitchen"
    assert "kitchen, shard (trusted)" in checks[-1].detail


def test_no_key_fails_with_what_to_give_and_no_login_is_tried():
    checks, setup = member_checks(NatsSettings(), "client", None)
    assert [(check.check, check.verdict) for check in checks] == [("credentials", "fail")]
    assert "--creds FILE" in checks[0].fix and not setup.may_connect


def test_an_open_broker_is_a_warning_and_a_login_is_tried():
    checks, setup = member_checks(NatsSettings(insecure=True), "shard", None)
    assert verdicts(checks) == {"credentials": "warn"} and setup.may_connect


def test_a_key_others_may_read_fails_saying_what_to_run(community):
    key = key_of(community, "alice")
    key.chmod(0o644)
    checks, setup = member_checks(NatsSettings(creds_file=key), "client", None)
    assert verdicts(checks) == {"key": "fail"} and not setup.may_connect
    assert "readable by others (mode 644)" in checks[0].detail and "chmod 600" in checks[0].detail


def test_a_missing_key_fails_naming_the_command_that_makes_one(tmp_path):
    checks, _ = member_checks(NatsSettings(creds_file=tmp_path / "keys" / "bob.nk"), "client", "bob")
    assert verdicts(checks) == {"key": "fail"}
    assert "hearth community keygen --name bob" in checks[0].fix


def test_no_roster_beside_the_key_fails_a_shard_host_and_warns_a_client(community, tmp_path):
    moved = tmp_path / "elsewhere" / "kitchen.nk"
    moved.parent.mkdir()
    key_of(community, "kitchen").rename(moved)
    shard_checks, _ = member_checks(NatsSettings(creds_file=moved), "shard", None)
    client_checks, setup = member_checks(NatsSettings(creds_file=moved), "client", None)
    assert verdicts(shard_checks)["roster"] == "fail" and verdicts(client_checks)["roster"] == "warn"
    assert "roster_file" in shard_checks[-1].fix and setup.may_connect


def test_a_roster_that_does_not_read_fails(community):
    (community.directory / "roster.json").write_text("{}")
    checks, setup = member_checks(NatsSettings(creds_file=key_of(community, "alice")), "client", None)
    assert verdicts(checks)["roster"] == "fail" and "is not a hearth roster" in checks[-1].detail
    assert not setup.may_connect


def test_a_roster_copy_of_another_community_does_not_name_the_key(community, tmp_path):
    other = Community.init(tmp_path / "other", "oak-lane")
    (community.directory / "roster.json").write_bytes((other.directory / "roster.json").read_bytes())
    checks, setup = member_checks(NatsSettings(creds_file=key_of(community, "alice")), "client", None)
    assert verdicts(checks)["member"] == "fail" and "is not a member of the roster" in checks[-1].detail
    assert not setup.may_connect


def test_a_key_of_another_role_fails_naming_both_roles_and_the_command(community):
    checks, setup = member_checks(NatsSettings(creds_file=key_of(community, "alice")), "orchestrator", None)
    assert verdicts(checks)["member"] == "fail" and not setup.fits_role and setup.may_connect
    assert "alice, a client, not an orchestrator" in checks[-1].detail
    assert "hearth community add --name NAME --role orchestrator" in checks[-1].detail


def test_the_gateway_logs_in_with_a_callers_key(community):
    checks, _ = member_checks(NatsSettings(creds_file=key_of(community, "kitchen")), "gateway", None)
    assert verdicts(checks)["member"] == "fail" and "not a client" in checks[-1].detail


def test_a_name_the_key_does_not_belong_to_fails(community):
    checks, _ = member_checks(NatsSettings(creds_file=key_of(community, "alice")), "client", "hub")
    assert checks[-1].verdict == "fail" and "belongs to alice, not hub" in checks[-1].detail
    assert "hub's own key" in checks[-1].fix
    checks, _ = member_checks(NatsSettings(creds_file=key_of(community, "alice")), "client", "carol")
    assert "the roster has no member carol" in checks[-1].detail
    assert checks[-1].fix == "the steward adds carol: hearth community add --name carol --role client"


def test_a_shard_host_below_trusted_gets_no_login(community):
    checks, _ = member_checks(NatsSettings(creds_file=key_of(community, "lodger")), "shard", None)
    assert checks[-1].verdict == "fail" and "trusted as member" in checks[-1].detail


def test_the_key_is_found_in_the_community_folder_by_name(community):
    assert key_file_for(NatsSettings(), community.directory, "alice") == key_of(community, "alice")
    assert key_file_for(NatsSettings(creds_file=Path("k.nk")), community.directory, "alice") == Path("k.nk")
    assert key_file_for(NatsSettings(), community.directory, None) is None


def test_tls_files_that_load_pass_and_a_certificate_with_another_key_fails(tmp_path):
    files = write_throwaway_ca(tmp_path / "tls", validity_days=365)
    assert tls_check(NatsSettings()).verdict == "ok"
    good = tls_check(NatsSettings(tls_ca_file=files.ca_file, tls_cert_file=files.client_cert_file,
                                  tls_key_file=files.client_key_file))
    assert good.verdict == "ok" and "matches its key" in good.detail
    mismatched = tls_check(NatsSettings(tls_ca_file=files.ca_file, tls_cert_file=files.client_cert_file,
                                        tls_key_file=files.server_key_file))
    assert mismatched.verdict == "fail" and "cannot use the TLS files" in mismatched.detail
    assert tls_check(NatsSettings(tls_cert_file=files.client_cert_file)).verdict == "fail"
    assert tls_check(NatsSettings(tls_ca_file=tmp_path / "missing.pem")).verdict == "fail"


def test_tls_certificates_that_end_soon_warn_and_ended_or_not_begun_ones_fail(tmp_path):
    files = write_throwaway_ca(tmp_path / "tls", validity_days=90)
    chosen = [files.ca_file, files.client_cert_file]
    now = datetime.datetime.now(datetime.timezone.utc)
    assert certificate_dates_check(chosen, "loads", now).verdict == "ok"
    soon = certificate_dates_check(chosen, "loads", now + datetime.timedelta(days=80))
    assert soon.verdict == "warn" and "days from now" in soon.detail and "--replace" in soon.fix
    ended = certificate_dates_check(chosen, "loads", now + datetime.timedelta(days=91))
    assert ended.verdict == "fail" and "ended on" in ended.detail
    early = certificate_dates_check(chosen, "loads", now - datetime.timedelta(days=2))  # a clock two days behind
    assert early.verdict == "fail" and "after this machine's clock" in early.detail
    # The throwaway CA of a demo (7 days) says so at once, through the check the command runs.
    short = write_throwaway_ca(tmp_path / "short")
    assert tls_check(NatsSettings(tls_ca_file=short.ca_file, tls_cert_file=short.client_cert_file,
                                  tls_key_file=short.client_key_file)).verdict == "warn"


@pytest.mark.parametrize("free,verdict", [(10 * GiB, "ok"), (low_disk_warn_bytes - 1, "warn"),
                                          (low_disk_fail_bytes - 1, "fail")])
def test_the_free_disk_decides_the_verdict(tmp_path, free, verdict):
    [check] = disk_checks([tmp_path], free_of=lambda _folder: free)
    assert check.verdict == verdict and str(tmp_path) in check.detail


def test_a_full_disk_holding_hearths_cache_points_at_hearth_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    [other] = disk_checks([tmp_path / "state"], free_of=lambda _folder: low_disk_warn_bytes - 1)
    [cache] = disk_checks([tmp_path / "cache"], free_of=lambda _folder: low_disk_warn_bytes - 1)
    assert "hearth cache" not in other.fix and "`hearth cache list`" in cache.fix


def test_folders_not_made_yet_are_judged_by_their_disk_once_per_disk(tmp_path):
    seen = []
    checks = disk_checks([tmp_path / "state" / "hearth", tmp_path / "cache"],
                         free_of=lambda folder: seen.append(folder) or 10 * GiB)
    assert len(checks) == 1 and seen == [tmp_path]
    assert "state/hearth" in checks[0].detail and "cache" in checks[0].detail


def test_the_gateways_api_keys(community):
    settings = HearthSettings(nats=NatsSettings(creds_file=key_of(community, "alice")))
    assert api_keys_check(None, HearthSettings(), on_community_mesh=False).verdict == "skip"
    assert api_keys_check(community.directory, HearthSettings(), on_community_mesh=False).verdict == "fail"
    missing = api_keys_check(None, settings, on_community_mesh=True)
    assert missing.verdict == "fail" and "hearth community api-key" in missing.detail
    create_api_key(community.directory, "alice")
    found = api_keys_check(None, settings, on_community_mesh=True)
    assert found.verdict == "ok" and "1 keys of 1 members" in found.detail


def test_a_configuration_that_forbids_serving_shards_fails_a_shard_host_only(monkeypatch):
    monkeypatch.setenv("HEARTH_SHARD__SERVE_SHARDS", "false")
    settings = HearthSettings()
    assert configuration_check(None, settings, "host").verdict == "fail"
    assert configuration_check(None, settings, "client").verdict == "ok"


def test_a_failure_fails_the_report_and_warnings_and_skips_do_not():
    passed = DoctorReport.of("client", [ok("a", "fine"), warn("b", "hm", "do x"), skip("c", "later")])
    failed = DoctorReport.of("client", [ok("a", "fine"), fail("d", "broken", "run y")])
    assert (passed.passed, passed.exit_code) == (True, 0) and (failed.passed, failed.exit_code) == (False, 1)
    assert failed.checks[1].line() == "FAIL  d: broken; fix: run y"
    assert passed.checks[0].line() == "ok    a: fine"
    assert json.loads(failed.model_dump_json())["checks"][1] == {"check": "d", "verdict": "fail", "detail": "broken",
                                                                 "fix": "run y"}


def test_the_stewards_key_passes_for_hearth_chat_which_it_may_call_with(community):
    """Orchestrators take calls from the steward's key too (CALLER_ROLES); a gateway, serving others, still needs a
    client's."""
    checks, setup = member_checks(NatsSettings(creds_file=key_of(community, "system")), "client", None)
    assert verdicts(checks)["member"] == "ok" and setup.fits_role, checks[-1]
    checks, _ = member_checks(NatsSettings(creds_file=key_of(community, "system")), "gateway", None)
    assert verdicts(checks)["member"] == "fail" and "not a client" in checks[-1].detail
