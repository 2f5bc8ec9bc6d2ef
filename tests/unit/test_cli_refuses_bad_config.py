"""Every command that reads the configuration refuses an invalid one (a bad value in the environment or the file, an
unknown key, a file that is not TOML) in one line naming the setting, exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.config import ConfigError, load_settings
from hearth.services.replay.cli import app as replay_app
from hearth.trust.community import Community

BAD_ENV = {"HEARTH_NATS__CONNECT_TIMEOUT_S": "abc"}


@pytest.fixture()
def community(tmp_path) -> Path:
    directory = tmp_path / "community"
    Community.init(directory, "elm-street")
    Community(directory).add("kitchen", "shard")
    return directory


def commands(community: Path) -> list[tuple[object, list[str]]]:
    """(app, argv) of commands that reach for the configuration before they reach for anything else."""
    broker = ["--nats", "nats://127.0.0.1:1"]  # never reached: the configuration is refused first
    return [
        (app, ["models", "--insecure"]),
        (app, ["chat", "hello", "--insecure", *broker]),
        (app, ["community", "streams", "--dir", str(community), *broker]),
        (app, ["community", "clear-quarantine", "m:0-1@kitchen", "--reason", "fixed", "--dir", str(community),
               *broker]),
        (app, ["community", "remove", "--name", "kitchen", "--dir", str(community), *broker]),
        (app, ["projector", "--db", str(community / "rm.sqlite"), "--insecure", *broker]),
        (app, ["orchestrator", "--insecure", *broker]),
        (app, ["shard", "--model", "m", "--layers", "0-1", "--insecure", *broker]),
        (app, ["host", "--model", "m", "--insecure", *broker]),
        (app, ["gateway", "--insecure", *broker]),
        (app, ["demo", "--max-tokens", "1"]),  # before, it started its NATS first, and a process it started refused
        (app, ["bench", "--model", "random:tiny", "--repeats", "1"]),
        (replay_app, ["events", *broker]),
        (replay_app, ["pipeline", "p1", *broker]),
    ]


def assert_refused_in_one_line(result, *named: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "invalid configuration" in lines[0] or "configuration file" in lines[0]
    for name in named:
        assert name in lines[0], lines[0]


def test_an_invalid_environment_value_is_refused_by_every_command_naming_its_variable(community, monkeypatch):
    monkeypatch.delenv("HEARTH_CONFIG", raising=False)
    for command_app, argv in commands(community):
        result = CliRunner().invoke(command_app, argv, env=BAD_ENV)
        assert_refused_in_one_line(result, "$HEARTH_NATS__CONNECT_TIMEOUT_S", "valid number")
        assert not (community / "rm.sqlite").exists()
    assert Community(community).roster().by_name("kitchen") is not None  # the refused removal changed nothing


@pytest.mark.parametrize("toml, named", [
    ('[nats]\nconnect_timeout_s = "abc"\n', ("[nats] connect_timeout_s in", "valid number")),
    ("[nats]\nconect_timeout_s = 3\n", ("[nats] conect_timeout_s", "unknown key")),
    ("[nats\nurl = 1\n", ("is not valid TOML", "line 1")),
])
def test_an_invalid_file_is_refused_naming_its_key(community, tmp_path, toml, named, monkeypatch):
    monkeypatch.delenv("HEARTH_NATS__CONNECT_TIMEOUT_S", raising=False)
    config = tmp_path / "hearth.toml"
    config.write_text(toml)
    for command_app, argv in commands(community):
        assert_refused_in_one_line(CliRunner().invoke(command_app, ["--config", str(config), *argv]), *named)
        assert_refused_in_one_line(CliRunner().invoke(command_app, argv, env={"HEARTH_CONFIG": str(config)}), *named)


def test_a_folder_given_as_the_configuration_file_is_refused(tmp_path):
    assert_refused_in_one_line(CliRunner().invoke(app, ["--config", str(tmp_path), "models", "--insecure"]),
                               "is a folder")


def test_the_community_commands_read_the_file_config_names(community, tmp_path, monkeypatch):
    """`hearth --config FILE community ...` reads FILE (they used to read $HEARTH_CONFIG's file only)."""
    monkeypatch.delenv("HEARTH_CONFIG", raising=False)
    config = tmp_path / "hearth.toml"
    config.write_text("[nats]\nconnect_timeout_s = -1\n")
    result = CliRunner().invoke(app, ["--config", str(config), "community", "streams", "--dir", str(community)])
    assert_refused_in_one_line(result, "[nats] connect_timeout_s", "greater than 0")


@pytest.mark.parametrize("env, named", [
    ({"HEARTH_TRANSPORT__STEP_TIMEOUT_S": "soon"}, "$HEARTH_TRANSPORT__STEP_TIMEOUT_S: Input should be"),
    ({"HEARTH_NATS": "not json"}, 'error parsing value for field "nats"'),
])
def test_load_settings_raises_one_line_config_errors(monkeypatch, env, named):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_the_demo_and_the_bench_hand_the_configuration_they_were_given_to_the_processes_they_start(tmp_path,
                                                                                                   monkeypatch):
    """Before, `hearth --config FILE demo` (and `bench`) ran its mesh on the defaults, while HEARTH_CONFIG reached
    its processes."""
    from hearth.services.devtools.bench import command
    from hearth.services.devtools.demo import DemoRun

    monkeypatch.delenv("HEARTH_CONFIG", raising=False)
    config = tmp_path / "hearth.toml"
    config.write_text("[nats]\nconnect_timeout_s = 7\n")
    given: list[dict[str, str]] = []
    monkeypatch.setattr(DemoRun, "run", lambda self: given.append(self.configuration_env) or 0)
    assert CliRunner().invoke(app, ["--config", str(config), "demo"]).exit_code == 0
    assert CliRunner().invoke(app, ["demo"]).exit_code == 0
    assert given == [{"HEARTH_CONFIG": str(config.resolve())}, {}]
    benched: list[dict[str, str]] = []
    monkeypatch.setattr(command, "run_bench_command", lambda options, as_json: benched.append(options.child_env) or 0)
    assert CliRunner().invoke(app, ["--config", str(config), "bench", "--env", "A=1"]).exit_code == 0
    assert benched == [{"HEARTH_CONFIG": str(config.resolve()), "A": "1"}]
