"""hearth's own files are found wherever a command runs: a bundled model by its name from any folder; what a process
keeps across restarts goes to the XDG state folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hearth.services.common.hearth_files import bundled_model_or, data_dir, state_dir

BUNDLED = "hearth-tiny-llama"
command_timeout_s = 120


def test_a_bundled_models_name_means_its_folder_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bundled_model_or(BUNDLED) == str(data_dir("models") / BUNDLED)
    assert bundled_model_or(f"models/{BUNDLED}") == str(data_dir("models") / BUNDLED)


def test_other_names_and_existing_paths_are_left_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / BUNDLED).mkdir()  # a folder of that name here is what the user means
    assert bundled_model_or(BUNDLED) == BUNDLED
    for model in ("HuggingFaceTB/SmolLM2-135M", "no-such-model", "models/no-such-model", "store:tiny",
                  "ollama:llama3.2:1b", str(tmp_path / "missing")):
        assert bundled_model_or(model) == model


def test_hearth_shard_loads_the_bundled_model_by_its_name_outside_the_checkout(tmp_path):
    """Past loading the model, it stops at the broker it cannot reach (nothing listens on port 1)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1",
                   "HEARTH_NATS__CONNECT_TIMEOUT_S": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "shard", "--model", BUNDLED, "--layers", "0-1", "--insecure",
         "--nats", "nats://127.0.0.1:1"], cwd=tmp_path, env=environment, capture_output=True, text=True,
        timeout=command_timeout_s)
    assert "cannot reach NATS" in completed.stderr, completed.stderr
    assert not Path(tmp_path / "models").exists()


def test_hearth_host_plans_over_the_bundled_model_by_its_name_outside_the_checkout(tmp_path):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1",
                   "HEARTH_NATS__CONNECT_TIMEOUT_S": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "host", "--model", f"models/{BUNDLED}", "--memory-budget-mb",
         "100", "--insecure", "--nats", "nats://127.0.0.1:1"], cwd=tmp_path, env=environment, capture_output=True,
        text=True, timeout=command_timeout_s)
    assert "cannot reach NATS" in completed.stderr, completed.stderr


def test_the_state_folder_is_xdg_state_home_s_when_absolute_else_the_xdg_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert state_dir("event-outbox") == tmp_path / "state" / "hearth" / "event-outbox"
    for ignored in ("", "relative/state"):
        monkeypatch.setenv("XDG_STATE_HOME", ignored)
        assert state_dir("event-outbox") == tmp_path / "home" / ".local" / "state" / "hearth" / "event-outbox"
