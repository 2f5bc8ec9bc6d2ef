"""hearth-replay takes --creds where every other command does, after its subcommand, as well as before it; a key file
it cannot use is said in one line, not a traceback (hearth/services/replay/cli.py, exits.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.replay.cli import app
from hearth.trust.community import Community
from hearth.trust.keys import MemberKey

UNREACHABLE = "nats://127.0.0.1:1"
SUBCOMMANDS = {
    "events": ["events"], "pipeline": ["pipeline", "p-1"], "shard": ["shard", "tiny:0-1@attic"],
    "rebuild": ["rebuild", "--db", "{tmp}/rebuilt.sqlite"], "verify": ["verify"],
}


@pytest.fixture
def lone_key(tmp_path):
    """An auditor's key handed over alone: no roster beside it, which a check against the roster refuses."""
    community = Community.init(tmp_path / "community", "creds")
    lone = tmp_path / "home" / "eve.nk"
    MemberKey.load(community.add("eve", "auditor").seed_file).save(lone)
    return lone


def invoke(arguments: list[str]):
    result = CliRunner().invoke(app, arguments)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
@pytest.mark.parametrize("place", ["after", "before"])
def test_creds_is_taken_before_or_after_the_subcommand(subcommand, place, tmp_path, monkeypatch):
    monkeypatch.delenv("HEARTH_NATS__CREDS_FILE", raising=False)
    missing = tmp_path / "nowhere" / "eve.nk"
    command = [part.format(tmp=tmp_path) for part in SUBCOMMANDS[subcommand]]
    creds = ["--creds", str(missing)]
    result = invoke([*creds, *command, "--nats", UNREACHABLE] if place == "before"
                    else [*command, *creds, "--nats", UNREACHABLE])
    # The key named, not the broker: the option reached the settings this invocation reads.
    assert result.exit_code == 1, result.output
    assert str(missing) in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert "cannot reach" not in result.stderr


def test_creds_after_the_subcommand_wins_over_the_one_before_it(lone_key, tmp_path, monkeypatch):
    monkeypatch.delenv("HEARTH_NATS__CREDS_FILE", raising=False)
    result = invoke(["--creds", str(tmp_path / "nowhere.nk"), "verify", "--creds", str(lone_key),
                     "--nats", UNREACHABLE])
    assert result.exit_code == 1 and "no community roster for the key" in result.stderr, result.output


def creds_help(arguments: list[str]) -> str:
    flat = " ".join(invoke([*arguments, "--help"]).output.split())
    return flat[flat.index("--creds"):flat.index("--help")]


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_every_subcommand_says_what_the_command_says_about_creds(subcommand):
    assert creds_help([SUBCOMMANDS[subcommand][0]]) == creds_help([]), creds_help([SUBCOMMANDS[subcommand][0]])
