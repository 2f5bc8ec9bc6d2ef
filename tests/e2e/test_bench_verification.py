"""`hearth bench --verify all --replicas 2 --json` end to end on a tiny random shape: every layer range served twice,
every hop-step of the measured rounds checked on the other replica, and the report saying so.

No speed is asserted here (BENCHMARKS.md, "Honest shards: what checks cost", holds the measured figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hearth.services.devtools.bench.report import BenchReport
from hearth.services.orchestrator.check_policy import CHECK_OUTCOMES

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4
REPEATS = 2
SHARDS = 3
REPLICAS = 2

pytestmark = [pytest.mark.timeout(300), pytest.mark.scheduled_first]


def test_bench_with_replicas_checks_every_hop_step_of_its_rounds_and_reports_it(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "bench", "--model", "random:tiny", "--cache-dir", str(tmp_path),
         "--shards", str(SHARDS), "--replicas", str(REPLICAS), "--verify", "all", "--prompt-tokens", "12",
         "--new-tokens", str(NEW_TOKENS), "--repeats", str(REPEATS), "--sessions", "1", "--torch-threads", "1",
         "--no-library-defaults", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = BenchReport.model_validate_json(completed.stdout)
    assert report.settings["verify"] == "all" and report.settings["replicas"] == REPLICAS
    assert report.greedy_outputs_match
    # Every range is served by REPLICAS shard processes, each with its own node.
    assert len(report.shard_memory) == SHARDS * REPLICAS
    assert len({shard.shard_id.rsplit("@", 1)[1] for shard in report.shard_memory}) == SHARDS * REPLICAS
    # A call's steps are its prefill and NEW_TOKENS - 1 decode steps; at `all` each hop of each is checked once on
    # one mirror, and a clean check confirms both the hop and the mirror.
    checked_hop_steps = REPEATS * NEW_TOKENS * SHARDS
    assert report.verification_checks == {**{outcome: 0 for outcome in CHECK_OUTCOMES},
                                          "confirmed": 2 * checked_hop_steps}
