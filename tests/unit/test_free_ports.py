"""free_tcp_port (hearth/services/broker/server.py): ports for servers started a moment later come from below the
kernel's ephemeral range (so no outgoing connection can take one first), are free to listen on, and are never
handed out twice in one process."""

from __future__ import annotations

import socket

from hearth.services.broker.server import _first_ephemeral_port, free_tcp_port, listen_port_floor


def test_ports_are_listenable_distinct_and_below_the_ephemeral_range():
    ports = [free_tcp_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(listen_port_floor <= port < _first_ephemeral_port() for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))
        sock.listen()

