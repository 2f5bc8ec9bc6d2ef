"""hearth-replay refuses, in one line and before it connects, a --since, --from-time or --subject it cannot use."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.replay.cli import app

UNREACHABLE = "nats://127.0.0.1:1"


@pytest.mark.parametrize("option", [
    ["--since", "99999999999d"],  # beyond what a duration holds
    ["--since", "3000000d"],  # before the calendar's first day
    ["--from-time", "0001-01-01T00:00:00+05:00"],  # before it once in UTC
    ["--subject", "hearth.events.shard..withdrawn"],  # an empty token
    ["--subject", "hearth.events.shard.a b"],  # whitespace
    ["--subject", "hearth.events.>.withdrawn"],  # `>` before the end
    ["--subject", "hearth.events.shard.\x1b"],  # a control character
])
def test_an_option_it_cannot_use_is_one_line_and_exit_2(option):
    result = CliRunner().invoke(app, ["events", *option, "--nats", UNREACHABLE])

    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0, result.output
    assert "cannot reach" not in result.stderr
