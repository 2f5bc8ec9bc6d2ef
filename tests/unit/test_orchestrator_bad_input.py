"""`hearth orchestrator` given input it cannot use (a --preload or --local-model of this machine that does not exist
or is no checkpoint, a device this machine has not) says so in one line and exits 2, before it dials the broker, as
`hearth host` and `hearth shard` do (tests/unit/test_host_bad_input.py): before, these exited 1, as a refusal of the
mesh's would, and a missing --preload was found only once connected."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.lifecycle import CommandInputRefused, CommandRefused
from hearth.services.orchestrator.main import refusal_of
from tests.integration.tiny_shard_server import MODEL

# Nothing listens there: a command that dialled it would say the broker is unreachable (exit 1), not refuse its input.
NO_BROKER = "nats://127.0.0.1:1"


def orchestrator(*args: str):
    return CliRunner().invoke(app, ["orchestrator", "--insecure", "--nats", NO_BROKER, "--node-id", "o1", *args])


def refusal_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if "WARNING" not in line and line.strip()]
    return line


@pytest.mark.parametrize(("option", "model", "said"), [
    ("--preload", lambda tmp_path: str(tmp_path / "nope"), "hearth orchestrator: --preload: unknown model "),
    ("--preload", lambda tmp_path: str(tmp_path / "notes.txt"), "hearth orchestrator: --preload: unknown model "),
    ("--local-model", lambda tmp_path: str(tmp_path / "nope.gguf"), "hearth orchestrator: --local-model "),
], ids=["preload-missing", "preload-not-a-checkpoint", "local-model-missing"])
def test_a_model_of_this_machine_that_cannot_be_used_is_one_line_and_exit_code_2(option, model, said, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    spec = model(tmp_path)
    result = orchestrator(option, spec)
    assert result.exit_code == 2, result.output
    line = refusal_line(result.output)
    assert line.startswith(said) and spec in line and "cannot reach" not in line, line
    assert "Traceback" not in result.output


@pytest.mark.parametrize("spec", ["store:some-model", "some-org/some-model"])
def test_a_model_fetched_from_elsewhere_is_refused_with_exit_code_1(spec):
    # The store or the hub may fail for now (the broker, the network): not the caller's input.
    refused = refusal_of(spec, "why")
    assert isinstance(refused, CommandRefused) and not isinstance(refused, CommandInputRefused)
    assert isinstance(refusal_of(str(MODEL), "why"), CommandInputRefused)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where torch sees no CUDA device")
def test_a_device_this_machine_has_not_is_one_line_and_exit_code_2():
    result = orchestrator("--device", "cuda")
    assert result.exit_code == 2, result.output
    assert refusal_line(result.output) == ("hearth orchestrator: device 'cuda' asked for, but torch sees no CUDA "
                                           "device here")
