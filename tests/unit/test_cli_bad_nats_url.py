"""A NATS URL nats-py cannot read (a port out of range, no host, another scheme) is refused before anything connects:
as --nats or $HEARTH_NATS_URL by every command (a usage error, exit code 2), as [nats] url by the configuration, and
by connect_nats itself; before, nats-py's parse ended the command in a traceback."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from hearth.services.broker.connection import connect_nats
from hearth.services.cli import app
from hearth.services.common.config import ConfigError, load_settings
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.common.nats_urls import server_urls
from hearth.services.replay.cli import app as replay_app
from hearth.trust.community import Community

OUT_OF_RANGE = "nats://127.0.0.1:99999"


@pytest.mark.parametrize(("url", "why"), [
    (OUT_OF_RANGE, "Port out of range"),
    ("::::", "is not a URL"),
    ("http://broker:4222", "scheme 'http' is not one of nats, tls, ws, wss"),
    ("nats://:4222", "names no host"),
    ("nats://a:4222,nats://b:x", "'nats://b:x' is not a URL"),
    ("nats://broker:0", "port 0"),
    (" , ", "no NATS URL"),
])
def test_a_url_nats_py_cannot_read_is_refused_in_one_line(url, why):
    with pytest.raises(ValueError) as refusal:
        server_urls(url)
    assert why in str(refusal.value) and "\n" not in str(refusal.value), refusal.value


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "localhost", "broker:4222", "tls://h:4222",
                                 "nats://[::1]:4222", "nats://a:1, nats://b:2", "ws://h:8080"])
def test_the_urls_nats_py_reads_are_taken(url):
    assert server_urls(url)


def test_a_refusal_does_not_show_the_password_in_the_url():
    with pytest.raises(ValueError) as refusal:
        server_urls("nats://member:s3cret@broker:99999")
    assert "s3cret" not in str(refusal.value) and "***@broker:99999" in str(refusal.value)


def test_the_configuration_refuses_such_a_url_naming_the_key(tmp_path):
    config = tmp_path / "hearth.toml"
    config.write_text(f'[nats]\nurl = "{OUT_OF_RANGE}"\n')
    with pytest.raises(ConfigError) as refusal:
        load_settings(config)
    assert "[nats] url" in str(refusal.value) and "Port out of range" in str(refusal.value)


def test_connect_nats_refuses_such_a_url_in_one_line():
    with pytest.raises(CommandRefused, match="Port out of range"):
        asyncio.run(connect_nats(OUT_OF_RANGE))


def commands(tmp_path) -> list[tuple[object, list[str]]]:
    community = tmp_path / "community"
    Community.init(community, "elm-street")
    return [
        (app, ["chat", "hello", "--insecure"]),
        (app, ["models", "--insecure"]),
        (app, ["shard", "--model", "m", "--layers", "0-1", "--insecure"]),
        (app, ["projector", "--db", str(tmp_path / "rm.sqlite"), "--insecure"]),
        (app, ["weights", "list", "--insecure"]),
        (app, ["community", "streams", "--dir", str(community)]),
        (replay_app, ["events"]),
    ]


@pytest.mark.parametrize("given", ["option", "environment"])
def test_every_command_refuses_such_a_url_in_one_line(given, tmp_path, monkeypatch):
    """As --nats (or $HEARTH_NATS_URL, which --nats reads): a usage error. The community commands read the variable
    as [nats] url's default: their refusal of what connect_nats refused, exit code 1."""
    monkeypatch.delenv("HEARTH_NATS_URL", raising=False)
    monkeypatch.delenv("HEARTH_CONFIG", raising=False)
    for application, argv in commands(tmp_path):
        env = {"HEARTH_NATS_URL": OUT_OF_RANGE} if given == "environment" else {}
        result = CliRunner().invoke(application, [*argv, "--nats", OUT_OF_RANGE] if given == "option" else argv,
                                    env=env)
        assert result.exception is None or isinstance(result.exception, SystemExit), (argv, result.exception)
        assert "Traceback" not in result.output and "Port out of range" in result.output, (argv, result.output)
        if given == "option" or argv[0] != "community":
            assert result.exit_code == 2 and "Invalid value for '--nats'" in result.output, (argv, result.output)
        else:
            assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, (argv, result.output)
