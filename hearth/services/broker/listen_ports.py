"""free_tcp_port: a TCP port for a server started a moment later (a broker, a cluster route, a metrics endpoint),
handed out once on this machine while the process that handed it out lives.

Drawn below the kernel's ephemeral range, not by binding port 0: a port from that range may be taken as the source
port of any outgoing connection (another cluster node's, a client's) before the server it was handed to listens on
it, and then that server cannot start ("bind: address already in use", e.g. for a NATS cluster node's route port).
A port is handed out once per process, and claimed for the user's other processes too (several test workers, two
demos): a lock file per port in the user's own folder of the temporary directory, held (flock) by the process that
handed the port out, for the newest `max_port_claims_held` of its ports. So two processes never hand out the same
port in the moment between its draw and its server listening. Where that folder cannot be had (a read-only
temporary directory; a link, or someone else's, in its place) a port is only checked free, as a process alone would.
"""

from __future__ import annotations

import collections
import fcntl
import os
import random
import socket
import stat
import tempfile
from pathlib import Path

from hearth.services.common.config_sections import loopback_host

EPHEMERAL_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Listening ports are drawn from [listen_port_floor, the kernel's first ephemeral port).
listen_port_floor = 20000
PORT_CLAIMS_DIR_PREFIX = "hearth-port-claims-"  # then the user's id
# Claims a process holds at once (one open file each): far more than the servers it starts at a time.
max_port_claims_held = 256
_ports_handed_out: set[int] = set()
_claims: collections.OrderedDict[int, int] = collections.OrderedDict()  # port -> the claim's file descriptor


def _first_ephemeral_port() -> int:
    try:
        return int(EPHEMERAL_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_claims_dir() -> Path | None:
    """The user's folder of port claims, made if need be; None where it cannot be had, or is a link or not the
    user's own (the temporary directory is shared)."""
    folder = Path(tempfile.gettempdir()) / f"{PORT_CLAIMS_DIR_PREFIX}{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = folder.lstat()
    except OSError:
        return None
    return folder if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() else None


def claim_port(port: int) -> bool:
    """Claim `port` for this process against the user's other processes; False when another one holds it (True,
    unclaimed, when claims cannot be made here)."""
    folder = port_claims_dir()
    if folder is None:
        return True
    try:
        descriptor = os.open(folder / f"{port}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return False
    _claims[port] = descriptor
    while len(_claims) > max_port_claims_held:
        os.close(_claims.popitem(last=False)[1])  # its server has listened long since
    return True


def free_tcp_port(host: str = loopback_host) -> int:
    """A TCP port free to listen on now, for a server started a moment later, that no other process of this
    machine handed out and still holds (see the module)."""
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral - listen_port_floor >= 1000:
        for _ in range(200):
            port = random.randrange(listen_port_floor, first_ephemeral)
            if port in _ports_handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            if not claim_port(port):
                continue
            _ports_handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room below the ephemeral range
        sock.bind((host, 0))
        return sock.getsockname()[1]
