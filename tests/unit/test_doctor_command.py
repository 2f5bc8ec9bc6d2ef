"""`hearth doctor` on the command line: bad options exit 2 before any check, a check that fails exits 1 with its line
(a configuration that does not load is one), `--json` is the same report as one document, and no key or password is
printed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.trust.community import Community


# No broker listens on port 1: the login gives up after this.
QUICK_GIVE_UP = {"HEARTH_NATS__CONNECT_TIMEOUT_S": "0.2"}


def doctor(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, ["doctor", *args], env=env)


@pytest.mark.parametrize("args,said", [
    (["--role", "printer"], "one of shard, host, orchestrator, projector, client, gateway"),
    (["--role", "client", "--model", "m"], "is for shard, host, orchestrator"),
    (["--role", "projector", "--memory-budget-mb", "100"], "is for shard, host"),
    (["--role", "client", "--name", "a.b"], "is no member name"),
    (["--role", "host", "--memory-budget-mb", "inf"], "--memory-budget-mb"),
    (["--role", "client", "--nats", "nats://hub:99999"], "--nats"),
])
def test_bad_options_exit_2_before_any_check(args, said):
    result = doctor(*args)
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()) and "configuration:" not in result.output


def test_a_configuration_that_does_not_load_fails_in_one_line(tmp_path):
    config = tmp_path / "hearth.toml"
    config.write_text("[nats]\nconect_timeout_s = 2\n")
    result = CliRunner().invoke(app, ["--config", str(config), "doctor", "--role", "client"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("FAIL  configuration: ") and "conect_timeout_s" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_no_key_fails_and_the_broker_checks_are_skipped_without_dialling(tmp_path):
    result = doctor("--role", "client", "--nats", "nats://127.0.0.1:1", "--community", str(tmp_path))
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[1].startswith("FAIL  credentials: no member key; fix: give --creds FILE")
    assert [line.split(":")[0] for line in lines if line.startswith("skip")] == [
        "skip  broker", "skip  clock", "skip  orchestrators"]


def test_json_is_the_same_report_and_no_seed_is_printed(tmp_path):
    community = Community.init(tmp_path / "community", "elm-street")
    added = community.add("alice", "client")
    seed = added.seed_file.read_text().strip()
    args = ("--role", "client", "--community", str(community.directory), "--name", "alice", "--nats",
            "nats://user:secret@127.0.0.1:1")
    lines = doctor(*args, env=QUICK_GIVE_UP)
    as_json = doctor(*args, "--json", env=QUICK_GIVE_UP)
    report = json.loads(as_json.output)
    assert report["role"] == "client" and report["passed"] is False and as_json.exit_code == 1
    assert [check["check"] for check in report["checks"]][:5] == ["configuration", "key", "roster", "member", "tls"]
    broker = next(check for check in report["checks"] if check["check"] == "broker")
    assert broker["verdict"] == "fail" and "nats://***@127.0.0.1:1" in broker["detail"]
    for output in (lines.output, as_json.output):
        assert seed not in output and "secret" not in output and added.member.public_key not in output
