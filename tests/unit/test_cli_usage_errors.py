"""A usage error (an option value out of range, an option missing or unknown, a command that does not exist) is one
line naming the command, what is wrong and where the help is, exit code 2, for every command of `hearth` and
`hearth-replay` (services.cli_errors.OneLineErrorsGroup) and `python -m hearth.services.projector`
(OneLineErrorsCommand), instead of click's usage, hint and error lines; a command
given no arguments still shows its help."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.projector.__main__ import app as projector_app
from hearth.services.replay.cli import app as replay_app


@pytest.mark.parametrize(("application", "argv", "command", "said"), [
    (app, ["shard", "--model", "m", "--layers", "0-1", "--metrics-port", "-1"], "shard",
     "Invalid value for '--metrics-port': Input should be greater than or equal to 0"),
    (app, ["host", "--model", "m", "--memory-budget-mb", "0"], "host", "Invalid value for '--memory-budget-mb'"),
    # Before, "Input should be less than or equal to 1000000000000": NaN compares false with either bound.
    (app, ["host", "--model", "m", "--memory-budget-mb", "nan"], "host",
     "Invalid value for '--memory-budget-mb': Input should be a finite number"),
    (app, ["host", "--model", "m", "--memory-budget-mb", "inf"], "host", "Input should be a finite number"),
    (app, ["chat", "hi", "--temperature", "nan"], "chat",
     "Invalid value for '--temperature': Input should be a finite number"),
    (app, ["gateway", "--port", "65536"], "gateway", "Invalid value for '--port'"),
    (app, ["chat", "hi", "--temperature", "-1"], "chat", "Invalid value for '--temperature'"),
    # Before, refused by the request's own checks: `error bad_request: ...`, exit code 1.
    (app, ["chat", "hi", "--temperature", "1e308"], "chat",
     "Invalid value for '--temperature': Input should be less than or equal to 10"),
    (app, ["chat", "hi", "--seed", "-1"], "chat", "Invalid value for '--seed': Input should be greater than or equal"),
    (app, ["chat", "hi", "--seed", str(2**63)], "chat", "Invalid value for '--seed': Input should be less than"),
    (app, ["chat"], "chat", "Missing argument 'prompt'"),
    (app, ["shard", "--bogus"], "shard", "No such option: --bogus"),
    (app, ["nosuch"], "", "No such command 'nosuch'"),
    (app, ["--log-level", "LOUD", "status"], "", "unknown log level 'LOUD'"),
    (app, ["dashboards", "render"], "dashboards render", "Missing option '--db'"),
    (app, ["community", "add", "--name", "x"], "community add", "Missing option '--role'"),
    (app, ["bench", "--replicas", "0"], "bench", "expected at least 1 shard process per layer range"),
    # Before, these loaded the layers and ended in a traceback (hop weight, ttl), or heartbeated without pause.
    (app, ["shard", "--model", "m", "--layers", "0-1", "--hop-weight", "-5"], "shard",
     "Invalid value for '--hop-weight': expected a number above 0, got -5"),
    (app, ["shard", "--model", "m", "--layers", "0-1", "--hop-weight", "nan"], "shard", "got nan"),
    (app, ["shard", "--model", "m", "--layers", "0-1", "--ttl-s", "0"], "shard", "'--ttl-s': expected a number"),
    (app, ["shard", "--model", "m", "--layers", "0-1", "--heartbeat-s", "0"], "shard", "'--heartbeat-s': expected"),
    (app, ["orchestrator", "--step-timeout-s", "inf"], "orchestrator", "'--step-timeout-s': expected a number"),
    (replay_app, ["events", "--bogus"], "events", "No such option: --bogus"),
    # `python -m hearth.services.projector`, one command: before, click's usage line and rich's boxed error.
    (projector_app, ["--bogus"], "", "No such option: --bogus"),
    (projector_app, ["--db", "x.sqlite", "--metrics-port", "-1"], "", "Invalid value for '--metrics-port'"),
    (projector_app, [], "", "Missing option '--db'"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_usage_error_is_one_line_naming_the_command(application, argv, command, said):
    result = CliRunner().invoke(application, argv, prog_name="hearth")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    path = " ".join(filter(None, ("hearth", command)))
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"{path}: ") and said in lines[0] and lines[0].endswith(f"(see {path} --help)"), \
        lines[0]


@pytest.mark.parametrize("argv", [[], ["community"]])
def test_a_command_given_no_arguments_shows_its_help(argv):
    result = CliRunner().invoke(app, argv, prog_name="hearth")
    assert "Usage: hearth" in result.output and "Commands:" in result.output, result.output


def _command_paths(command, path=()):
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _command_paths(sub, (*path, name))


def test_every_commands_help_names_its_options_types_plainly():
    # Before, a finite-float option (`hearth host --memory-budget-mb`, `hearth chat --temperature`) showed its type
    # as the repr of its pydantic annotation: `<typing.Annotated[float, FieldInfo(...)]>`.
    import typer

    for path in _command_paths(typer.main.get_command(app)):
        result = CliRunner().invoke(app, [*path, "--help"], prog_name="hearth", terminal_width=200)
        assert result.exit_code == 0, result.output
        assert "typing." not in result.output and "FieldInfo" not in result.output, (path, result.output)
