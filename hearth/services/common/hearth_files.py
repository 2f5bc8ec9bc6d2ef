"""Where hearth's own files are: its data folders (models/, nats/, grafana/, prometheus/, docs/), and the folder of
the state a process keeps across its restarts (`state_dir`).

In a checkout the data folders lie beside the `hearth` package; a wheel installs them as the data package
`hearth_data` (pyproject.toml, [tool.setuptools]), so beside it too, one level down.
"""

from __future__ import annotations

import os
from pathlib import Path

# The folder holding the `hearth` package: the checkout, or site-packages.
SOURCES_ROOT = Path(__file__).resolve().parents[3]
DATA_PACKAGE = "hearth_data"
DATA_FOLDERS = ("models", "nats", "grafana", "prometheus", "docs")


def data_dir(folder: str) -> Path:
    """One of DATA_FOLDERS: hearth_data/<folder> where hearth is installed from its wheel, else the checkout's."""
    if folder not in DATA_FOLDERS:
        raise ValueError(f"{folder!r} is not one of hearth's data folders {DATA_FOLDERS}")
    installed = SOURCES_ROOT / DATA_PACKAGE / folder
    return installed if installed.is_dir() else SOURCES_ROOT / folder


def installed_from_wheel() -> bool:
    """Whether this hearth runs from an installed wheel (its data package beside it) rather than from a checkout."""
    return (SOURCES_ROOT / DATA_PACKAGE).is_dir()


def installed_files_refusal(command: str, folder: Path) -> str | None:
    """Why `command`, given no --out, may not write into `folder`, its default among hearth's own files: an installed
    hearth's are part of its package (site-packages), never rewritten in place; None in a checkout, where writing
    them is how they are made."""
    if not installed_from_wheel():
        return None
    return (f"{command}: this hearth is installed, and {folder} is part of its package; pass --out DIR to write "
            "into a folder of your own")


def bundled_model_or(model: str) -> str:
    """`model` as given, unless it names a model bundled with hearth (`hearth-tiny-llama`, or
    `models/hearth-tiny-llama` as the checkout's README writes it) and no such path exists here: then the bundled
    folder's path, so that an installed hearth, run from any folder, finds it by name instead of asking the hub."""
    if Path(model).expanduser().exists():
        return model
    name = model.removeprefix("models/")
    if name and "/" not in name and (data_dir("models") / name / "config.json").is_file():
        return str(data_dir("models") / name)
    return model


def state_dir(folder: str) -> Path:
    """`folder` in the folder of what hearth processes keep across restarts: $XDG_STATE_HOME/hearth, else
    ~/.local/state/hearth (the XDG base directory default; a relative XDG_STATE_HOME is ignored, as it says);
    not created here."""
    base = Path(os.environ.get("XDG_STATE_HOME") or "")
    if not base.is_absolute():
        base = Path.home() / ".local" / "state"
    return base / "hearth" / folder
