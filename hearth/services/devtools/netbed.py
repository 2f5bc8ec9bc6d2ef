"""NetBed: households on one machine for tests and experiments, as Linux network namespaces joined by links.

One namespace is the hub (the broker and the orchestrator live there); each household gets its own, joined to
the hub by a veth pair whose hub end is a port of a bridge in the hub. Every address is from the benchmarking
range 198.18.0.0/15 and exists only inside the namespaces the bed creates: nothing is added to, or routed
through, the machine's own network namespace, and the veth pairs are created inside the bed's namespaces, so no
interface of the machine's is ever touched. A link can be cut and healed (`ip link set ... down/up` on its hub
end, the processes behind it left running) and shaped to a bandwidth (`tc` tbf on both ends). netem, and with it
a kernel-added delay, does not exist on every kernel: a household's broker connection is given its round-trip time by
a relay in the hub (`start_relay`, hearth/services/devtools/netbed_relay.py) that the household dials instead of the
broker.

Names carry the creating process's pid, so parallel runs never meet; `close()` (also run at exit) deletes the
namespaces and with them every link, and `sweep_stale()` deletes what a run that was killed left behind.
Needs root and iproute2: `unavailable_reason()` says why a bed cannot be made here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import itertools
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from hearth.services.common.child_processes import process_alive
from hearth.services.devtools.netbed_relay import Link, RelayProcess

# The benchmarking range (RFC 2544): never routed on the internet, and here only inside the bed's namespaces.
BED_NETWORK = ipaddress.ip_network("198.18.0.0/24")
HUB_ADDRESS = BED_NETWORK.network_address + 1
# Household i is .(first_household_host + i).
first_household_host = 10
max_households = 200
NAME_PREFIX = "hbed"
HUB_BRIDGE = "br0"
HOUSEHOLD_INTERFACE = "eth0"
ip_command_timeout_s = 10.0
# How long a healed link may take to forward again, and how often heal() looks.
heal_timeout_s = 10.0
heal_poll_interval_s = 0.05
# How long a new bed's households may take to reach the hub, and how long each probe's connection may take.
link_up_timeout_s = 10.0
link_probe_timeout_s = 0.5
# tbf needs a bucket of at least one timer tick's worth of bytes at the rate (HZ is 100 to 1000).
shaping_bucket_ticks_per_s = 100
shaping_smallest_bucket_bytes = 16 * 1024
# How long a packet may wait in a shaped queue before it is dropped (tbf's `latency`).
shaping_queue_latency_ms = 50
# Household i's relay port on the hub's address (start_relay); the hub's namespace is the bed's own, so fixed
# ports never meet another run's.
relay_base_port = 14000
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"
_bed_numbers = itertools.count()


class NetBedError(RuntimeError):
    """A command building or changing the bed failed; the message names it and carries its stderr."""


def unavailable_reason() -> str | None:
    """Why no bed can be made on this machine (None: one can)."""
    if not os.uname().sysname == "Linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{NAME_PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=ip_command_timeout_s)
    if result.returncode != 0:
        raise NetBedError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")


def sweep_stale() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone (a run killed before it cleaned up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NAME_PREFIX}(\d+)x\d+-\w+", name)
        if match and not process_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Place:
    """One namespace of the bed and its address there."""

    namespace: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Put before a command to run it inside this namespace."""
        return ["ip", "netns", "exec", self.namespace]


class NetBed:
    """A hub and `households` households; `up()` builds it and returns once every household reaches the hub,
    `close()` (or leaving the `with`) removes it."""

    def __init__(self, households: int) -> None:
        if not 1 <= households <= max_households:
            raise ValueError(f"a bed has 1 to {max_households} households, not {households}")
        stem = f"{NAME_PREFIX}{os.getpid()}x{next(_bed_numbers)}"
        self.hub = Place(f"{stem}-hub", str(HUB_ADDRESS))
        self.households = [Place(f"{stem}-h{index}", str(HUB_ADDRESS + first_household_host - 1 + index))
                           for index in range(households)]
        self._made: list[str] = []
        self.relays: list[RelayProcess] = []

    @staticmethod
    def relay_port(index: int) -> int:
        """The port on the hub's address where household `index` reaches the broker through a relay."""
        return relay_base_port + index

    @staticmethod
    def hub_port(index: int) -> str:
        """The hub end of household `index`'s link (an interface in the hub's namespace)."""
        return f"to-h{index}"

    def up(self) -> "NetBed":
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        prefix = BED_NETWORK.prefixlen
        for place in (self.hub, *self.households):
            _run("ip", "netns", "add", place.namespace)
            self._made.append(place.namespace)
            _run("ip", "-n", place.namespace, "link", "set", "lo", "up")
        hub = self.hub.namespace
        _run("ip", "-n", hub, "link", "add", HUB_BRIDGE, "type", "bridge")
        _run("ip", "-n", hub, "addr", "add", f"{self.hub.address}/{prefix}", "dev", HUB_BRIDGE)
        _run("ip", "-n", hub, "link", "set", HUB_BRIDGE, "up")
        for index, household in enumerate(self.households):
            port = self.hub_port(index)
            # Both ends are born inside the bed's namespaces: the machine's own namespace never sees them.
            _run("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", HOUSEHOLD_INTERFACE,
                 "netns", household.namespace)
            _run("ip", "-n", hub, "link", "set", port, "master", HUB_BRIDGE)
            _run("ip", "-n", hub, "link", "set", port, "up")
            _run("ip", "-n", household.namespace, "addr", "add", f"{household.address}/{prefix}", "dev",
                 HOUSEHOLD_INTERFACE)
            _run("ip", "-n", household.namespace, "link", "set", HOUSEHOLD_INTERFACE, "up")
        self._wait_reachable()

    def _wait_reachable(self) -> None:
        """Until every household opens a TCP connection to the hub, at most link_up_timeout_s: a link just set up
        may drop packets for a moment (the kernel activates a device's queue a little after its carrier)."""
        with self.entered(self.hub):
            listener = socket.create_server((self.hub.address, 0))
        with listener:
            port = listener.getsockname()[1]
            deadline = time.monotonic() + link_up_timeout_s
            for index, household in enumerate(self.households):
                with self.entered(household):
                    while True:
                        try:
                            socket.create_connection((self.hub.address, port), timeout=link_probe_timeout_s).close()
                            break
                        except OSError as error:
                            if time.monotonic() > deadline:
                                raise NetBedError(f"household {index} does not reach the hub within "
                                                  f"{link_up_timeout_s} s: {error}") from None
                            time.sleep(heal_poll_interval_s)

    def cut(self, index: int) -> None:
        """Take household `index`'s link down at the hub: its packets are dropped, its processes keep running."""
        _run("ip", "-n", self.hub.namespace, "link", "set", self.hub_port(index), "down")

    def heal(self, index: int) -> None:
        """Bring household `index`'s link back up, and return once its bridge port forwards again (bounded by
        heal_timeout_s): a port that was down starts forwarding only a moment after it is set up."""
        _run("ip", "-n", self.hub.namespace, "link", "set", self.hub_port(index), "up")
        deadline = time.monotonic() + heal_timeout_s
        while not self._port_forwards(index):
            if time.monotonic() > deadline:
                raise NetBedError(f"household {index}'s link did not come back within {heal_timeout_s} s")
            time.sleep(heal_poll_interval_s)

    def _port_forwards(self, index: int) -> bool:
        shown = subprocess.run(["ip", "-n", self.hub.namespace, "-d", "link", "show", "dev", self.hub_port(index)],
                               capture_output=True, text=True, timeout=ip_command_timeout_s).stdout
        return "LOWER_UP" in shown and "state forwarding" in shown

    def shape(self, index: int, rate_mbit: float) -> None:
        """Limit household `index`'s link to `rate_mbit` each way (a token bucket on both of its ends)."""
        if not rate_mbit > 0:
            raise ValueError(f"a link's rate must be above 0 Mbit/s, not {rate_mbit}")
        bucket_bytes = max(shaping_smallest_bucket_bytes, int(rate_mbit * 1e6 / 8 / shaping_bucket_ticks_per_s))
        tbf = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(bucket_bytes), "latency",
               f"{shaping_queue_latency_ms}ms"]
        _run("ip", "netns", "exec", self.hub.namespace, "tc", "qdisc", "replace", "dev", self.hub_port(index), *tbf)
        _run("ip", "netns", "exec", self.households[index].namespace, "tc", "qdisc", "replace", "dev",
             HOUSEHOLD_INTERFACE, *tbf)

    def shaped_counters(self, index: int) -> dict[str, int]:
        """What household `index`'s outgoing shaper has done so far: bytes `sent`, packets `dropped`, and
        `overlimits` (packets that had to wait for tokens: the link held them back)."""
        shown = subprocess.run(["ip", "netns", "exec", self.households[index].namespace, "tc", "-s", "qdisc", "show",
                                "dev", HOUSEHOLD_INTERFACE], capture_output=True, text=True,
                               timeout=ip_command_timeout_s).stdout
        match = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)", shown)
        if "tbf" not in shown or match is None:
            raise NetBedError(f"household {index}'s link is not shaped: {shown.strip()}")
        return dict(zip(("sent", "dropped", "overlimits"), map(int, match.groups())))

    def unshape(self, index: int) -> None:
        for namespace, device in ((self.hub.namespace, self.hub_port(index)),
                                  (self.households[index].namespace, HOUSEHOLD_INTERFACE)):
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                           capture_output=True, timeout=ip_command_timeout_s)

    def start_relay(self, upstream_port: int, rtt_ms: float = 0.0) -> RelayProcess:
        """A latency relay in the hub: household i dials `relay_url(i)` and reaches `upstream_port` on the hub's
        address with `rtt_ms` added (change it per household with the relay's `set_rtt(relay_port(i), ms)`)."""
        links = [Link(self.relay_port(index), upstream_port, rtt_ms) for index in range(len(self.households))]
        relay = RelayProcess(self.hub.address, links, self.hub.exec_prefix())
        self.relays.append(relay)
        return relay

    def relay_url(self, index: int, scheme: str = "nats") -> str:
        return f"{scheme}://{self.hub.address}:{self.relay_port(index)}"

    @contextlib.contextmanager
    def entered(self, place: Place) -> Iterator[None]:
        """Run the calling thread inside `place`'s namespace until the block ends (sockets it opens meanwhile
        stay there; so do children it forks). Only this thread moves: a network namespace is per thread."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net", "rb") as home, open(f"{_NETNS_DIR}/{place.namespace}", "rb") as there:
            if libc.setns(there.fileno(), _CLONE_NEWNET) != 0:
                raise NetBedError(f"cannot enter {place.namespace}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:
                    raise NetBedError(f"cannot leave {place.namespace}: {os.strerror(ctypes.get_errno())}")

    def namespaces(self) -> list[str]:
        return [place.namespace for place in (self.hub, *self.households)]

    def close(self) -> None:
        """Delete every namespace this bed made (their links and bridge go with them); safe to call twice."""
        atexit.unregister(self.close)
        while self.relays:
            self.relays.pop().stop()
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)

    def __enter__(self) -> "NetBed":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
