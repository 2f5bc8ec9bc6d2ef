"""`hearth weights publish` takes a path as `--model` does: `~` is expanded, so a path quoted for its spaces (which
the shell then leaves as it is) names the same file."""

from __future__ import annotations

from gguf import GGMLQuantizationType
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.cli_options import EXIT_BAD_INPUT

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)


def test_a_quoted_path_under_home_names_the_file_there(tiny_gguf, tmp_path, monkeypatch):  # noqa: F811
    source, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    # Cut short, so the loader's refusal, before any connection, shows the file was found and read.
    (models / "my model.gguf").write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    result = CliRunner().invoke(app, ["weights", "publish", "~/models/my model.gguf", "--name", "mine",
                                      "--nats", "nats://127.0.0.1:9", "--insecure"])

    assert result.exit_code == EXIT_BAD_INPUT
    assert "my model.gguf is truncated" in result.output, result.output
