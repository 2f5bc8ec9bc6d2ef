"""A damaged or hostile GGUF (or a symbolic link loop) given as the model of `hearth shard`, `hearth host` or `hearth
orchestrator` is the caller's input: one line naming the file and what is wrong, exit code 2, before the broker is
dialled and without a traceback, whichever command it is given to."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.devtools.demo_model import DemoError, resolve_demo_model

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .test_gguf_hostile import patched_info

# Nothing listens there: a command that dialled it would say the broker is unreachable (exit 1), not refuse its input.
NO_BROKER = "nats://127.0.0.1:1"
COMMANDS = {
    "shard": lambda model: ["shard", "--model", model, "--layers", "0-0"],
    "host": lambda model: ["host", "--model", model, "--memory-budget-mb", "100"],
    "orchestrator": lambda model: ["orchestrator", "--preload", model],
}


@pytest.fixture
def source(tiny_gguf):  # noqa: F811
    return tiny_gguf("llama", GGMLQuantizationType.Q8_0)[0]


def refusal_line(command: str, model: str) -> str:
    result = CliRunner().invoke(app, [*COMMANDS[command](model), "--insecure", "--nats", NO_BROKER, "--node-id", "n1",
                                      "--device", "cpu"])
    lines = [line for line in result.output.splitlines() if "WARNING" not in line]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_cut_gguf_is_the_callers_input_for_every_command(command, source, tmp_path, own_cache):  # noqa: F811
    """Before, `hearth shard` exited 1 for it, as for a mesh that refuses it, while `hearth host` exited 2."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:200])
    assert "cut.gguf is truncated: its header needs at least" in refusal_line(command, str(cut))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_tensor_of_a_type_no_gguf_reader_knows_is_refused_by_name(command, source, tmp_path,
                                                                    own_cache):  # noqa: F811
    """Before, the gguf package's reader met the type first: the line ended in `np.uint32(9999)` (a KeyError)."""
    patched = patched_info(source, tmp_path / "typed.gguf", "token_embd.weight", block_type=9999)
    line = refusal_line(command, str(patched))
    assert "tensor token_embd.weight of typed.gguf is stored as type 9999, a GGUF type hearth does not read" in line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("link", ["loop/a", "self.gguf"])
def test_a_symbolic_link_loop_is_refused_as_this_machines_not_looked_up_on_the_hub(command, link, tmp_path,
                                                                                   monkeypatch):
    """Before, `loop/a` (a loop of two links) read as a hub id: a host looked it up on the network and exited 1, an
    orchestrator dialled the broker; `self.gguf` (a link to itself) was said not to exist."""
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a").symlink_to("b")
    (tmp_path / "loop" / "b").symlink_to("a")
    (tmp_path / "self.gguf").symlink_to("self.gguf")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert f"{Path(link)} is a symbolic link that leads nowhere (a loop, or its target is missing)" in \
        refusal_line(command, link)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_holding_only_a_link_to_itself_is_said_to_have_no_config(command, tmp_path, monkeypatch):
    """Before, `hearth shard` said such a folder "has no safetensors weights beside its config.json": it has none."""
    (tmp_path / "looping").mkdir()
    (tmp_path / "looping" / "self").symlink_to(".")
    monkeypatch.chdir(tmp_path)
    assert refusal_line(command, "./looping").endswith("looping has no config.json")


def test_the_demo_bench_and_eval_name_a_tensor_of_a_type_no_gguf_reader_knows(source, tmp_path,
                                                                             own_cache):  # noqa: F811
    """Before, their torch-free description ended in the reader's `ValueError: np.uint32(9999) is not a valid
    GGMLQuantizationType`."""
    patched = patched_info(source, tmp_path / "typed.gguf", "token_embd.weight", block_type=9999)
    with pytest.raises(DemoError, match="tensor token_embd.weight of typed.gguf is stored as type 9999, a GGUF type "
                                        "hearth does not read"):
        resolve_demo_model(str(patched))
