"""free_tcp_port (hearth/services/broker/listen_ports.py): ports for servers started a moment later come from below
the kernel's ephemeral range (so no outgoing connection can take one first), are free to listen on, are never handed
out twice in one process, and are not handed out by another process of this machine while the one that handed it
out lives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from hearth.services.broker import listen_ports
from hearth.services.broker.listen_ports import _first_ephemeral_port, claim_port, free_tcp_port, listen_port_floor

ROOT = Path(__file__).resolve().parents[2]


def in_another_process(code: str) -> str:
    return subprocess.run([sys.executable, "-c", f"from hearth.services.broker.listen_ports import *; {code}"],
                          capture_output=True, text=True, check=True, cwd=ROOT, timeout=60).stdout.strip()


def test_ports_are_listenable_distinct_and_below_the_ephemeral_range():
    ports = [free_tcp_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(listen_port_floor <= port < _first_ephemeral_port() for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))
        sock.listen()


def test_a_port_handed_out_here_is_not_another_processs_while_this_one_lives():
    port = free_tcp_port()
    assert in_another_process(f"print(claim_port({port}))") == "False"
    # One handed out by a process that has ended is free to claim again.
    ended = int(in_another_process("print(free_tcp_port())"))
    assert claim_port(ended)


def test_a_process_holds_a_bounded_number_of_claims(monkeypatch):
    monkeypatch.setattr(listen_ports, "max_port_claims_held", 4)
    ports = [free_tcp_port() for _ in range(10)]
    assert len(listen_ports._claims) == 4
    assert list(listen_ports._claims) == ports[-4:]


def test_a_link_in_place_of_the_claims_folder_is_not_followed(tmp_path, monkeypatch):
    """The temporary directory is shared: a link someone put where the user's claims folder goes gets no claim."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"{listen_ports.PORT_CLAIMS_DIR_PREFIX}{os.getuid()}").symlink_to(elsewhere)

    assert listen_ports.port_claims_dir() is None
    assert claim_port(listen_port_floor) and not any(elsewhere.iterdir())
