"""Where hearth's own files are: its data folders (models/, nats/, grafana/, prometheus/) and its Python packages.

In a checkout the data folders lie beside the packages; a wheel installs them as the data package `hearth_data`
(pyproject.toml, [tool.setuptools]), so beside the packages too, one level down. hearth's packages install under
generic top-level names (`services`, `events`, ...): `pipx install` and `uv tool install` give hearth a virtual
environment of its own, and `exit_if_packages_shadowed` stops with one clear line where another distribution's
package of the same name is imported instead (renaming them into a `hearth.` namespace is the planned fix:
docs/operations.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The folder holding hearth's top-level packages: the checkout, or site-packages.
SOURCES_ROOT = Path(__file__).resolve().parents[2]
DATA_PACKAGE = "hearth_data"
DATA_FOLDERS = ("models", "nats", "grafana", "prometheus")
# Every top-level package hearth installs besides `services` (this file's own).
SIBLING_PACKAGES = ("events", "inference", "migrations", "protocol", "readmodels", "trust")


def data_dir(folder: str) -> Path:
    """One of DATA_FOLDERS: hearth_data/<folder> where hearth is installed from its wheel, else the checkout's."""
    if folder not in DATA_FOLDERS:
        raise ValueError(f"{folder!r} is not one of hearth's data folders {DATA_FOLDERS}")
    installed = SOURCES_ROOT / DATA_PACKAGE / folder
    return installed if installed.is_dir() else SOURCES_ROOT / folder


def shadowed_packages() -> list[str]:
    """`name (path)` for each of hearth's packages that is imported from somewhere other than beside `services`."""
    shadowed = []
    for name in SIBLING_PACKAGES:
        spec = importlib.util.find_spec(name)  # finds without importing (inference would load torch)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is None or origin.parent.parent != SOURCES_ROOT:
            shadowed.append(f"{name} ({origin.parent if origin else 'not found'})")
    return shadowed


def exit_if_packages_shadowed() -> None:
    """Stop, naming them, when another distribution's package takes the place of one of hearth's."""
    shadowed = shadowed_packages()
    if shadowed:
        raise SystemExit(
            f"hearth: its packages are shadowed by others of the same name: {', '.join(shadowed)} instead of beside "
            f"{SOURCES_ROOT}; install hearth into an environment of its own (`pipx install hearth-*.whl`)")
