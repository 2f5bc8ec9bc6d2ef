"""compose.yaml, checked without Docker: every hearth command and flag it names exists and parses (the real
typer/click parser), every repository file it mounts or the image copies exists, ports, health checks and the
Prometheus targets agree with the commands, and prometheus/prometheus.yml parses (and passes `promtool check
config` where promtool is installed: `make tools`). The community and the NATS configuration the cluster
nodes write are checked for real in test_compose_community.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
import typer.main
import yaml

from hearth.services.cli import app
from hearth.services.common.config import HearthSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
HEARTH = typer.main.get_command(app)
# Where `make tools` unpacks Debian's prometheus package (the venv's tools folder), else PATH.
PROMTOOL = Path(sys.executable).parent.parent / "tools" / "prometheus" / "usr" / "bin" / "promtool"

NATS_NODES = sorted(name for name, service in SERVICES.items() if (service.get("command") or [None])[0] == "nats")
HEARTH_SERVICES = sorted(name for name, service in SERVICES.items()
                         if "build" in service and "entrypoint" not in service and service.get("command"))
# Processes that serve (and /metrics), not the steward's one-shot `community streams`.
SERVING_SERVICES = [name for name in HEARTH_SERVICES if SERVICES[name]["command"][0] != "community"]


def option(command: list[str], flag: str) -> str:
    assert flag in command, (flag, command)
    return command[command.index(flag) + 1]


def parsed(command: list[str]) -> click.Context:
    """`hearth COMMAND ARGS` through the CLI's own parser: unknown flags, bad values, missing options raise."""
    name, *args = command
    assert name in HEARTH.commands, f"hearth has no command {name!r}"
    subcommand = HEARTH.commands[name]
    if hasattr(subcommand, "commands"):  # a group: `community streams`
        name, *args = args
        subcommand = subcommand.commands[name]
    known = {opt for param in subcommand.params for opt in (*param.opts, *param.secondary_opts)}
    unknown = [arg for arg in args if arg.startswith("--") and arg.split("=")[0] not in known]
    assert unknown == [], f"hearth {name} has no {unknown}"
    return subcommand.make_context(f"hearth {name}", list(args))


def health_port(service: dict) -> int:
    test = " ".join(service["healthcheck"]["test"])
    return int(re.search(r"http://127\.0\.0\.1:(\d+)/", test).group(1))


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    mounts = [volume.split(":") for volume in service.get("volumes") or []]
    return [(source, target) for source, target, *_ in mounts if source.startswith(".")]


@pytest.mark.parametrize("name", HEARTH_SERVICES)
def test_every_hearth_command_and_flag_exists_and_parses(name):
    parsed(SERVICES[name]["command"])


def test_the_services_are_the_ones_the_deployment_needs():
    assert NATS_NODES == ["nats-0", "nats-1", "nats-2"]
    commands = {name: SERVICES[name]["command"][0] for name in HEARTH_SERVICES}
    assert sorted(commands.values()) == (["community", "gateway"] + ["nats"] * 3 + ["orchestrator", "projector"]
                                         + ["shard"] * 3)
    assert {"community", "prometheus", "grafana", "you"} <= set(SERVICES)


MOUNTED_SOURCES = sorted({source for service in SERVICES.values() for source, _ in bind_mounts(service)})


@pytest.mark.parametrize("source", MOUNTED_SOURCES)
def test_every_repository_path_the_services_mount_exists(source):
    assert (REPO_ROOT / source).exists(), f"compose.yaml mounts {source}, which the repository lacks"


def test_the_image_carries_the_sources_the_bundled_model_and_the_cluster_configuration():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+) (\S+)$", dockerfile, flags=re.MULTILINE)
    for source, _ in copied:
        assert (REPO_ROOT / source).exists(), source
    assert {"models", "nats", "hearth"} <= {source for source, _ in copied}
    # Every folder pyproject.toml maps into the data package: without one, `pip install -e .` stops at "package
    # directory 'grafana' does not exist" before anything is installed.
    package_dirs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) <= {source for source, _ in copied}
    # Editable: the code runs from /app and finds models/ and nats/ beside it, as it does in a checkout.
    assert re.search(r"pip install [^\n]*-e \.", dockerfile)
    from hearth.services.broker.cluster import cluster_config_file
    from hearth.services.orchestrator.catalog import BUNDLED_MODELS_DIR

    assert BUNDLED_MODELS_DIR == REPO_ROOT / "models"
    assert cluster_config_file() == REPO_ROOT / "nats" / "hearth-cluster.conf"
    preload = option(SERVICES["orchestrator"]["command"], "--preload")
    assert (BUNDLED_MODELS_DIR / preload / "config.json").is_file()
    for name in HEARTH_SERVICES:
        if SERVICES[name]["command"][0] == "shard":
            assert (REPO_ROOT / option(SERVICES[name]["command"], "--model") / "config.json").is_file(), name


def test_the_nats_nodes_route_to_each_other_and_check_health_on_their_monitoring_port():
    cluster_addresses = {f"{name}:{option(SERVICES[name]['command'], '--cluster-port')}" for name in NATS_NODES}
    published = []
    for name in NATS_NODES:
        command = SERVICES[name]["command"]
        assert option(command, "--node") == name
        assert set(option(command, "--routes").split(",")) == cluster_addresses
        assert health_port(SERVICES[name]) == int(option(command, "--monitor-port"))
        host_port, container_port = SERVICES[name]["ports"][0].split(":")
        assert int(container_port) == int(option(command, "--port"))
        published.append(int(host_port))
        assert "/data" in option(command, "--store") and f"{name}-data:/data" in SERVICES[name]["volumes"]
    assert len(set(published)) == 3
    client_urls = {f"nats://{name}:{option(SERVICES[name]['command'], '--port')}" for name in NATS_NODES}
    for name in HEARTH_SERVICES + ["you"]:
        if name not in NATS_NODES:
            assert set(SERVICES[name]["environment"]["HEARTH_NATS_URL"].split(",")) == client_urls, name


def test_every_hearth_environment_variable_is_a_setting():
    for name in HEARTH_SERVICES + ["you"]:
        for key in SERVICES[name].get("environment") or {}:
            if key == "HEARTH_NATS_URL":
                continue
            section, field = key.removeprefix("HEARTH_").lower().split("__")
            assert field in HearthSettings.model_fields[section].annotation.model_fields, (name, key)


def test_health_checks_and_start_order_agree_with_the_commands():
    # [address:]host port, each published once.
    published = [port.rsplit(":", 1)[0] for service in SERVICES.values() for port in service.get("ports") or []]
    assert len(published) == len(set(published))
    for name, service in SERVICES.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert dependency in SERVICES, (name, dependency)
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], (name, dependency)
            elif condition["condition"] == "service_completed_successfully":
                assert "restart" not in SERVICES[dependency], (name, dependency)
        command = service.get("command") or []
        if "--ready-file" in command:
            assert service["healthcheck"]["test"][-1] == option(command, "--ready-file"), name
    assert health_port(SERVICES["projector"]) == int(option(SERVICES["projector"]["command"], "--metrics-port"))
    assert health_port(SERVICES["gateway"]) == int(option(SERVICES["gateway"]["command"], "--port"))
    for name in HEARTH_SERVICES:
        if name not in NATS_NODES:
            assert set(NATS_NODES) <= set(SERVICES[name]["depends_on"]), name


def test_prometheus_scrapes_every_hearth_process_on_its_metrics_port():
    prometheus = SERVICES["prometheus"]
    mounts = dict(bind_mounts(prometheus))
    config_path = option([arg for part in prometheus["command"] for arg in part.split("=", 1)], "--config.file")
    source = next(source for source, target in mounts.items() if target == config_path)
    config = yaml.safe_load((REPO_ROOT / source).read_text())
    targets = {target for job in config["scrape_configs"] for static in job["static_configs"]
               for target in static["targets"]}
    expected = {f"{name}:{option(SERVICES[name]['command'], '--metrics-port')}"
                for name in SERVING_SERVICES if name not in NATS_NODES}
    assert len(expected) == 6
    assert expected <= targets
    # /metrics listens on 127.0.0.1 unless told otherwise: Prometheus, in a container of its own, must be let in.
    for name in SERVING_SERVICES:
        if name not in NATS_NODES:
            command, environment = SERVICES[name]["command"], SERVICES[name]["environment"]
            host = (option(command, "--metrics-host") if "--metrics-host" in command
                    else environment.get("HEARTH_METRICS__HOST"))
            assert host == "0.0.0.0", name
    assert {target.split(":")[0] for target in targets} <= set(SERVICES) | {"localhost"}


def test_prometheus_and_grafana_are_published_on_the_loopback_only():
    # Prometheus answers every series it scraped (callers' names included) and Grafana starts as admin/admin, both
    # without TLS: published on every interface they would hand the LAN what /metrics keeps off it.
    for name in ("prometheus", "grafana"):
        for port in SERVICES[name]["ports"]:
            assert port.startswith("127.0.0.1:"), (name, port)


def test_prometheus_accepts_its_configuration():
    promtool = PROMTOOL if PROMTOOL.is_file() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make tools` unpacks Debian's prometheus package into the venv)")
    completed = subprocess.run([str(promtool), "check", "config", str(REPO_ROOT / "prometheus" / "prometheus.yml")],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_grafana_gets_the_sqlite_plugin_the_provisioning_the_dashboards_and_the_read_model():
    grafana = SERVICES["grafana"]
    assert "frser-sqlite-datasource" in grafana["environment"]["GF_INSTALL_PLUGINS"].split(",")
    mounts = dict(bind_mounts(grafana))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == "/var/lib/grafana/dashboards"
    read_model_volume = next(volume for volume in SERVICES["projector"]["volumes"] if volume.endswith(":/data"))
    assert f"{read_model_volume}:ro" in grafana["volumes"]
    datasources = REPO_ROOT / "grafana" / "provisioning" / "datasources"
    assert datasources.is_dir(), "grafana/provisioning/datasources is missing"
    paths = [source["jsonData"]["path"] for file in datasources.glob("*.y*ml")
             for source in yaml.safe_load(file.read_text())["datasources"] if "path" in source.get("jsonData", {})]
    assert paths == [option(SERVICES["projector"]["command"], "--db")]


# The processes that keep events in an outbox until the broker stores them, and the setting naming its folder.
OUTBOX_SETTINGS = {"orchestrator": "HEARTH_ORCHESTRATOR__EVENT_OUTBOX_DIR", "shard": "HEARTH_SHARD__EVENT_OUTBOX_DIR"}


@pytest.mark.parametrize("name", [name for name in HEARTH_SERVICES if SERVICES[name]["command"][0] in OUTBOX_SETTINGS])
def test_every_event_outbox_is_on_a_named_volume_of_its_own(name):
    """What a process said once and the broker had not stored yet (a shard's withdrawal, an orchestrator's audit
    events) must outlive its container: its own folder, the default under $XDG_STATE_HOME, does not outlive a
    re-create (`docker compose up` after a change). One volume per container, as each node keeps its own file."""
    service = SERVICES[name]
    outbox_dir = service["environment"][OUTBOX_SETTINGS[service["command"][0]]]
    named_volumes = [volume.split(":")[:2] for volume in service["volumes"] if not volume.startswith((".", "/"))]
    holding = [source for source, target in named_volumes if outbox_dir.startswith(target.rstrip("/") + "/")]
    assert len(holding) == 1 and holding[0] in COMPOSE["volumes"], (name, outbox_dir, service["volumes"])
    others = [source for other, each in SERVICES.items() if other != name
              for source, *_ in (volume.split(":") for volume in each.get("volumes") or [])]
    assert holding[0] not in others, (name, holding[0])
