"""`hearth host` given input it cannot use (a model that does not exist, a device or scheme this machine has no kernel
for, a budget that holds no layer) says so in one line and exits 2, as for a usage error, before it dials the broker:
before, these exited 1, as a refusal of the mesh's would."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.config import HearthSettings
from hearth.services.shard.main import ShardInputRefused, quantize_setting
from tests.integration.tiny_shard_server import MODEL

# Nothing listens there: a command that dialled it would say the broker is unreachable (exit 1), not refuse its input.
NO_BROKER = "nats://127.0.0.1:1"


def host(*args: str):
    return CliRunner().invoke(app, ["host", "--insecure", "--nats", NO_BROKER, "--node-id", "n1", *args])


@pytest.mark.parametrize(("model", "why"), [
    (lambda tmp_path: str(tmp_path / "nope"), "does not exist"),
    (lambda tmp_path: str(tmp_path / "nope.gguf"), "does not exist"),
    (lambda tmp_path: "ollama:no-such-model", "Ollama has not pulled"),
    (lambda tmp_path: str(tmp_path / "notes.txt"), "notes.txt is neither a checkpoint folder nor a GGUF file"),
    # A folder of the current one, named as a hub id would be: it exists, so it is this machine's.
    (lambda tmp_path: "broken-model", "has no config.json"),
])
def test_a_model_that_does_not_exist_is_one_line_and_exit_code_2(model, why, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "broken-model").mkdir()
    monkeypatch.chdir(tmp_path)
    result = host("--model", model(tmp_path), "--memory-budget-mb", "100")
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.output.splitlines() if "WARNING" not in line]
    assert line.startswith("hearth host: cannot plan a range of ") and why in line, line
    assert "Traceback" not in result.output


def test_an_empty_model_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch):
    """`--model ""` (a shell variable left unset) is Path(""), the current folder: the checkpoint found there was
    planned, and would have been served."""
    monkeypatch.chdir(shutil.copytree(MODEL, tmp_path / "checkpoint"))
    result = host("--model", "", "--memory-budget-mb", "100")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == ("hearth host: cannot plan a range of : no model named: give a checkpoint "
                                              "folder, a GGUF file or a hub model id")


def test_a_budget_that_holds_no_layer_is_one_line_with_its_figures_and_exit_code_2():
    """0.01 MB was shown as "a memory budget of 0.0 MB ... plus 0.0 MB kv_cache_budget_mb"."""
    result = host("--model", str(MODEL), "--memory-budget-mb", "0.01", "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        "hearth host: a memory budget of 0.01 MB holds no layer of hearth-tiny-llama: the smallest needs 3.0 MB plus "
        "0.0025 MB kv_cache_budget_mb")


def test_a_scheme_the_device_has_no_kernel_for_is_refused_as_input():
    with pytest.raises(ShardInputRefused, match="^--quantize: quantization int8 has no kernel on meta"):
        quantize_setting("int8", HearthSettings().research.distributed_inference.host, torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where torch sees no CUDA device")
def test_a_device_this_machine_has_not_is_one_line_and_exit_code_2():
    result = host("--model", str(MODEL), "--memory-budget-mb", "100", "--device", "cuda", "--quantize", "int4")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == "hearth host: device 'cuda' asked for, but torch sees no CUDA device here"
