"""compose.yaml's community, checked without Docker: its `community` service's script, run here, makes the keys
and certificates that every other service's command names, each key belonging to the role the command runs;
and with them each NATS node's configuration (nats/hearth-cluster.conf plus the community's authorization and
TLS) passes nats-server's own configuration test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hearth.trust.roster import Roster

REPO_ROOT = Path(__file__).resolve().parents[2]
HEARTH = str(Path(sys.executable).parent / "hearth")
COMMAND_ROLES = {"shard": "shard", "orchestrator": "orchestrator", "projector": "projector", "chat": "client",
                 "gateway": "client"}


SERVICES = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"]
NATS_NODES = [name for name, service in SERVICES.items() if (service.get("command") or [None])[0] == "nats"]


@pytest.fixture(scope="module")
def community_dir(tmp_path_factory) -> Path:
    """The folder the `community` service's script makes (run here, /community replaced by this folder)."""
    folder = tmp_path_factory.mktemp("community")
    script = SERVICES["community"]["command"][0].replace("/community", str(folder)).replace("$$", "$")
    script = script.replace("hearth ", f"{HEARTH} ")
    completed = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert completed.returncode == 0, completed.stderr
    return folder


def test_every_service_logs_in_with_a_key_the_community_service_made_for_its_role(community_dir):
    roster = Roster.load(community_dir / "roster.json")

    def local(path: str) -> Path:
        return Path(path.replace("/community", str(community_dir)))

    checked = 0
    for name, service in SERVICES.items():
        command = service.get("command") or []
        environment = service.get("environment") or {}
        for key in ("HEARTH_NATS__TLS_CA_FILE", "HEARTH_NATS__TLS_CERT_FILE", "HEARTH_NATS__TLS_KEY_FILE"):
            if key in environment:
                assert local(environment[key]).is_file(), (name, key)
        creds = command[command.index("--creds") + 1] if "--creds" in command else \
            environment.get("HEARTH_NATS__CREDS_FILE")
        if creds is None:
            continue
        member = next(m for m in roster.members if local(creds) == community_dir / "keys" / f"{m.name}.nk")
        role = COMMAND_ROLES[command[0]] if command else "client"
        assert member.role == role, (name, member)
        checked += 1
    assert checked == 7  # projector, three shards, orchestrator, the gateway, and the client `you`
    # The gateway signs calls as the member whose API key it is given: `you`'s key is kept for the operator, and
    # only its hash in api_keys.json, which the gateway reads from its --community folder.
    gateway = SERVICES["gateway"]["command"]
    assert local(gateway[gateway.index("--community") + 1]) == community_dir
    api_key = (community_dir / "you.api-key").read_text().strip()
    assert api_key and api_key not in (community_dir / "api_keys.json").read_text()
    assert (community_dir / "you.api-key").stat().st_mode & 0o077 == 0  # the shell writes it under umask 077
    assert "you" in (community_dir / "api_keys.json").read_text()
    for node in NATS_NODES:
        for option in ("--tls-cert", "--tls-key", "--tls-ca"):
            nats_command = SERVICES[node]["command"]
            assert local(nats_command[nats_command.index(option) + 1]).is_file()


@pytest.mark.parametrize("node", NATS_NODES)
def test_each_nats_node_configuration_passes_the_nats_server_configuration_test(community_dir, tmp_path, node):
    """`hearth nats --check` with the node's own arguments: it writes the configuration the node would run
    (nats/hearth-cluster.conf with its variables, the roster's authorization, TLS) and `nats-server -t` reads it."""
    arguments = [argument.replace("/community", str(community_dir)).replace("/data", str(tmp_path / "data"))
                 for argument in SERVICES[node]["command"]]
    completed = subprocess.run([sys.executable, "-m", "hearth.services.cli", *arguments, "--check"],
                               capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr
    assert "configuration valid" in completed.stderr
    written = (tmp_path / "data" / "hearth-nats.conf").read_text()
    assert "hearth-cluster.conf" in written and "authorization" in written and "verify: true" in written
