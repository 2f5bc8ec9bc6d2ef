"""compose.yaml's community, checked without Docker: its `community` service's script, run here, makes the keys
and certificates that every other service's command names, each key belonging to the role the command runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from trust.roster import Roster

REPO_ROOT = Path(__file__).resolve().parents[2]
HEARTH = str(Path(sys.executable).parent / "hearth")
COMMAND_ROLES = {"shard": "shard", "orchestrator": "orchestrator", "projector": "projector", "chat": "client"}


def test_every_service_logs_in_with_a_key_the_community_service_made_for_its_role(tmp_path):
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    services = compose["services"]
    script = services["community"]["command"][0].replace("/community", str(tmp_path)).replace("$$", "$")
    script = script.replace("hearth ", f"{HEARTH} ")
    completed = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert completed.returncode == 0, completed.stderr
    roster = Roster.load(tmp_path / "roster.json")

    def local(path: str) -> Path:
        return Path(path.replace("/community", str(tmp_path)))

    checked = 0
    for name, service in services.items():
        command = service.get("command") or []
        environment = service.get("environment") or {}
        for key in ("HEARTH_NATS__TLS_CA_FILE", "HEARTH_NATS__TLS_CERT_FILE", "HEARTH_NATS__TLS_KEY_FILE"):
            if key in environment:
                assert local(environment[key]).is_file(), (name, key)
        creds = command[command.index("--creds") + 1] if "--creds" in command else \
            environment.get("HEARTH_NATS__CREDS_FILE")
        if creds is None:
            continue
        member = next(m for m in roster.members if local(creds) == tmp_path / "keys" / f"{m.name}.nk")
        role = COMMAND_ROLES[command[0]] if command else "client"
        assert member.role == role, (name, member)
        checked += 1
    assert checked == 6  # projector, three shards, orchestrator, and the client `you`
    for option in ("--tls-cert", "--tls-key", "--tls-ca"):
        nats_command = services["nats"]["command"]
        assert local(nats_command[nats_command.index(option) + 1]).is_file()
