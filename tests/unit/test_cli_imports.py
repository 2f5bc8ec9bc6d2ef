"""`hearth` and `hearth-replay` start without torch: commands import their modules only when they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
HEAVY_MODULES = ("torch", "transformers")


def loaded_heavy_modules(code: str) -> list[str]:
    probe = f"{code}\nimport sys\nprint('LOADED=' + ','.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    marker = result.stdout.strip().splitlines()[-1]
    assert marker.startswith("LOADED="), result.stdout
    return [name for name in marker.removeprefix("LOADED=").split(",") if name]


def test_importing_the_hearth_cli_does_not_load_torch():
    assert loaded_heavy_modules("import hearth.services.cli") == []


@pytest.mark.parametrize(
    "argv",
    [
        ["hearth.services.replay.cli", "--help"],
        ["hearth.services.replay.cli", "events", "--help"],
        ["hearth.services.replay.cli", "rebuild", "--help"],
        ["hearth.services.cli", "--help"],
        ["hearth.services.cli", "nats", "--help"],
        ["hearth.services.cli", "projector", "--help"],
        ["hearth.services.cli", "db", "upgrade", "--help"],
        ["hearth.services.cli", "db", "vacuum", "--help"],
        ["hearth.services.cli", "doctor", "--help"],
    ],
)
def test_help_of_the_light_commands_does_not_load_torch(argv):
    module, *args = argv
    code = (
        f"import sys; sys.argv = ['prog', *{args!r}]\n"
        f"import {module} as cli\n"
        "try:\n    cli.main()\nexcept SystemExit as exit_:\n    assert exit_.code in (0, None), exit_.code\n"
    )
    assert loaded_heavy_modules(code) == []


def test_the_replay_modules_and_the_projector_do_not_load_torch():
    code = (
        "import hearth.services.replay.cli, hearth.services.replay.query, hearth.services.replay.reports\n"
        "import hearth.services.projector.main, hearth.readmodels.rebuild, hearth.events"
    )
    assert loaded_heavy_modules(code) == []


@pytest.mark.parametrize("script", ["hearth", "hearth-replay"])
def test_installed_entry_points_show_help(script):
    result = subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_python_dash_m_hearth_is_the_hearth_command_and_loads_no_torch():
    code = ("import sys, runpy; sys.argv = ['hearth', '--help']\n"
            "try:\n    runpy.run_module('hearth', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit_:\n    assert exit_.code in (0, None), exit_.code\n")
    assert loaded_heavy_modules(code) == []
    result = subprocess.run([sys.executable, "-m", "hearth", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage: " in result.stdout and "shard" in result.stdout


@pytest.mark.parametrize("args", [["shard", "--model", "m", "--layers", "0-1"], ["orchestrator"]])
def test_a_serving_command_refuses_missing_credentials_before_it_loads_torch(args):
    """Before, `hearth shard` and `hearth orchestrator` imported torch (seconds) and only then said they had no key."""
    code = (
        f"import sys; sys.argv = ['prog', *{args!r}, '--nats', 'nats://127.0.0.1:1']\n"
        "import hearth.services.cli as cli\n"
        "try:\n    cli.main()\nexcept SystemExit as exit_:\n    assert exit_.code not in (0, None), exit_.code\n"
    )
    assert loaded_heavy_modules(code) == []
