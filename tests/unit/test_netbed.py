"""NetBed (hearth/services/devtools/netbed.py): households reach the hub over their links, a cut link carries nothing
until healed, shaping installs a token bucket on both ends, and closing (even after a failure) leaves no namespace
behind."""

from __future__ import annotations

import socket
import subprocess

import pytest

from hearth.services.devtools.netbed import NetBed, NetBedError, sweep_stale, unavailable_reason

NO_BED = unavailable_reason()
pytestmark = pytest.mark.skipif(NO_BED is not None, reason=f"no network namespaces here: {NO_BED}")
connect_timeout_s = 1.0
healed_link_attempts = 5


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def reaches(bed: NetBed, household: int, port: int, *, attempts: int = 1) -> bool:
    """Whether a connection from the household to the hub's port succeeds, in up to `attempts` tries (a healed
    link's neighbours may still hold the failed address lookups of the cut)."""
    with bed.entered(bed.households[household]):
        for _ in range(attempts):
            try:
                socket.create_connection((bed.hub.address, port), timeout=connect_timeout_s).close()
                return True
            except OSError:
                continue
    return False


def test_households_reach_the_hub_and_a_cut_link_carries_nothing_until_healed():
    with NetBed(households=2) as bed:
        with bed.entered(bed.hub):
            listener = socket.create_server((bed.hub.address, 0))
        with listener:
            port = listener.getsockname()[1]
            assert reaches(bed, 0, port) and reaches(bed, 1, port)
            bed.cut(1)
            assert not reaches(bed, 1, port)
            assert reaches(bed, 0, port)
            bed.heal(1)
            assert reaches(bed, 1, port, attempts=healed_link_attempts)
        # The bed's addresses exist only inside its namespaces.
        with pytest.raises(OSError):
            socket.create_server((bed.hub.address, 0)).close()


def test_shaping_puts_a_token_bucket_on_both_ends_of_the_link():
    with NetBed(households=1) as bed:
        bed.shape(0, 20)
        for command in (bed.hub.exec_prefix() + ["tc", "qdisc", "show", "dev", bed.hub_port(0)],
                        bed.households[0].exec_prefix() + ["tc", "qdisc", "show", "dev", "eth0"]):
            shown = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            assert "tbf" in shown and "20Mbit" in shown, shown
        bed.unshape(0)
        with pytest.raises(ValueError):
            bed.shape(0, 0)


def test_everything_is_removed_after_a_failure_and_stale_beds_are_swept():
    # Only this test's namespaces are compared: another test process may make or remove its own bed meanwhile.
    with pytest.raises(RuntimeError, match="boom"):
        with NetBed(households=2) as bed:
            ours = set(bed.namespaces())
            assert len(ours) == 3 and ours <= namespaces()
            raise RuntimeError("boom")
    assert not ours & namespaces()
    # A bed left by a process that no longer exists.
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = f"hbed{finished.pid}x0-hub"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep_stale()
    assert stale not in namespaces()


def test_a_command_that_fails_names_itself():
    with NetBed(households=1) as bed:
        with pytest.raises(NetBedError, match="ip -n"):
            bed.cut(5)
