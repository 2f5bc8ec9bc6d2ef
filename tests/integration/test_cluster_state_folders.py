"""A LocalCluster's shard hosts keep their event outbox in the cluster's work folder, as its orchestrator does: in
the default state folder ($XDG_STATE_HOME) a withdrawal one mesh's host left unstored would be written by the next
host of that node id to whatever broker it serves then, another mesh's (`hearth demo` and the benches give their
hosts the same node ids run after run). Real processes, the bundled tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hearth.services.devtools.local_cluster import LocalCluster

MODEL = Path(__file__).resolve().parents[2] / "models" / "hearth-tiny-llama"
NODE = "outbox-node"
host_budget_mb = 4096.0  # the whole tiny model


@pytest.mark.parametrize("kind", ["shard", "host"])
def test_shard_hosts_keep_their_event_outbox_in_the_work_folder(tmp_path, kind):
    work_dir = tmp_path / "mesh"
    with LocalCluster(work_dir=work_dir, secure=False, metrics=False) as cluster:
        cluster.start_nats()
        if kind == "shard":
            cluster.start_shard(str(MODEL), 0, 1, node_id=NODE)
        else:
            cluster.start_host(str(MODEL), host_budget_mb, node_id=NODE)
        claimed = sorted(path.name for path in (work_dir / "shard-event-outbox").glob("*.sqlite"))
    assert claimed == [f"{NODE}.sqlite"]
    default_folder = Path(os.environ["XDG_STATE_HOME"]) / "hearth" / "shard-event-outbox"
    assert not list(default_folder.glob(f"{NODE}*"))
