"""`hearth community` given bad input ends with one line and a non-zero exit, never a traceback, and leaves no
half-made community behind (hearth/services/community_cli.py, hearth/trust/community.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.community_cli import community_app
from hearth.trust.community import Community
from hearth.trust.keys import KeyFileError, MemberKey
from hearth.trust.roster import Roster, seed_path


def refused_in_one_line(arguments: list[str], *expected: str) -> str:
    result = CliRunner().invoke(community_app, arguments)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # typer.Exit, not an error raised
    assert len(result.output.strip().splitlines()) == 1, result.output
    for text in expected:
        assert text in result.output, result.output
    return result.output


@pytest.fixture
def community(tmp_path):
    community = Community.init(tmp_path / "community", "elm-street")
    community.add("kitchen-pc", "shard")
    return community


@pytest.mark.parametrize("command", [["list"], ["reputation"]])
def test_a_read_model_that_is_not_a_database_is_said_in_one_line(community, tmp_path, command):
    not_a_database = tmp_path / "readmodel.sqlite"
    not_a_database.write_text("this is not a SQLite file\n" * 10)
    arguments = [*command, "--db", str(not_a_database)]
    if command == ["list"]:
        # The listing works without a read model: it only leaves out what the read model would add.
        result = CliRunner().invoke(community_app, [*arguments, "--dir", str(community.directory)])
        assert result.exit_code == 0 and result.exception is None, result.output
        assert "kitchen-pc" in result.output
    else:
        refused_in_one_line(arguments, str(not_a_database))


def test_clearing_against_a_read_model_that_is_not_a_database_is_said_in_one_line(community, tmp_path):
    not_a_database = tmp_path / "readmodel.sqlite"
    not_a_database.write_bytes(b"\x00" * 4096)
    refused_in_one_line(["clear-quarantine", "m:0-3@kitchen-pc", "--reason", "fixed", "--dir",
                         str(community.directory), "--db", str(not_a_database)], "not a hearth read model")


def test_init_over_a_left_over_system_key_writes_nothing(tmp_path):
    """A system key left in keys/ (a community whose roster was deleted): init refuses before writing a roster, so
    no roster without its steward is left behind to block the next init."""
    directory = tmp_path / "community"
    MemberKey.generate().save(seed_path(directory, "system"))
    refused_in_one_line(["init", "--name", "elm-street", "--dir", str(directory)], "not replacing a key")
    assert not (directory / "roster.json").exists()
    with pytest.raises(KeyFileError, match="not replacing a key"):
        Community.init(directory, "elm-street")
    assert not (directory / "roster.json").exists()


def test_init_refuses_a_bad_name_or_folder_in_one_line(tmp_path):
    refused_in_one_line(["init", "--name", "x" * 200, "--dir", str(tmp_path / "long")], "community")
    assert not (tmp_path / "long").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    refused_in_one_line(["init", "--name", "elm-street", "--dir", str(a_file)], str(a_file))


def test_nats_config_into_a_folder_that_does_not_exist_is_said_in_one_line(community, tmp_path):
    out = tmp_path / "no-such-folder" / "authorization.conf"
    refused_in_one_line(["nats-config", "--dir", str(community.directory), "--out", str(out)], str(out))


@pytest.mark.parametrize("host", ["", "bad host", "é.example", "a" * 300])
def test_tls_refuses_a_host_no_certificate_can_name(community, host):
    refused_in_one_line(["tls", "--host", host, "--dir", str(community.directory)], "--host")
    assert not (community.directory / "tls" / "ca.pem").exists()


def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_an_add_whose_roster_write_fails_is_said_in_one_line(community, monkeypatch):
    monkeypatch.setattr(Roster, "save", disk_full)
    refused_in_one_line(["add", "--name", "garage-pc", "--role", "shard", "--offline", "--dir",
                         str(community.directory)],
                        "No space left on device")
    # The key generated for it went with the roster write: nothing blocks adding it once there is room.
    assert not seed_path(community.directory, "garage-pc").exists()
    monkeypatch.undo()
    assert community.add("garage-pc", "shard").seed_file.is_file()


def test_a_removal_whose_roster_write_fails_says_to_run_it_again(community, monkeypatch):
    monkeypatch.setattr(Community, "remove", disk_full)
    refused_in_one_line(["remove", "--name", "kitchen-pc", "--dir", str(community.directory), "--offline"],
                        "No space left on device", "run it again")
    assert community.roster().by_name("kitchen-pc") is not None



def test_tls_names_every_file_it_wrote_and_which_ones_go_where(community):
    """Walking the docs: the summary named three of the five files, not the keys the broker's --tls-key and members'
    [nats] tls_key_file take, nor which files a member's machine needs."""
    made = CliRunner().invoke(community_app, ["tls", "--host", "127.0.0.1", "--dir", str(community.directory)])
    assert made.exit_code == 0, made.output
    said = " ".join(made.output.split())
    tls = community.directory / "tls"
    for name in ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem"):
        assert str(tls / name) in said
    assert "tls_ca_file" in said and "tls_cert_file" in said and "tls_key_file" in said


def test_tls_replaces_a_ca_only_when_asked_and_keeps_the_previous_one_aside(community):
    tls = community.directory / "tls"
    assert CliRunner().invoke(community_app, ["tls", "--host", "127.0.0.1", "--dir", str(community.directory)]
                              ).exit_code == 0
    first_ca = (tls / "ca.pem").read_bytes()
    refused_in_one_line(["tls", "--host", "127.0.0.1", "--dir", str(community.directory)], "already holds a CA",
                        "--replace")
    refused_in_one_line(["tls", "--host", "not a host", "--dir", str(community.directory), "--replace"], "--host")
    assert (tls / "ca.pem").read_bytes() == first_ca and not list(community.directory.glob("tls.replaced-*"))

    replaced = CliRunner().invoke(community_app, ["tls", "--host", "127.0.0.1", "--dir", str(community.directory),
                                                  "--replace"])
    assert replaced.exit_code == 0, replaced.output
    assert (tls / "ca.pem").read_bytes() != first_ca
    [aside] = community.directory.glob("tls.replaced-*")
    assert (aside / "ca.pem").read_bytes() == first_ca
