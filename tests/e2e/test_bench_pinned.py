"""`hearth bench --pin-cores N` end to end on a tiny random shape: the shards really ran pinned one per core, and
the report holds the baseline, every session count's aggregate and ratio, and the verdicts.

No speed is asserted (BENCHMARKS.md, "Together faster than alone", holds the measured figures).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.services.devtools.bench.together_report import TogetherReport
from hearth.services.devtools.local_cluster import PREFORK_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4
SESSIONS = (1, 3)
# Two cores where the machine has them; the check that one core per shard was used holds for any N.
CORES = min(2, len(os.sched_getaffinity(0)))

pytestmark = [pytest.mark.timeout(300), pytest.mark.scheduled_first]


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "bench", "--model", "random:tiny", "--cache-dir", str(tmp_path),
         "--prompt-tokens", "8", "--new-tokens", str(NEW_TOKENS), "--repeats", "1", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
        # As `hearth bench` runs for its users: each process started fresh and pinned by taskset, so this test keeps
        # LocalCluster's own start path covered while the rest of the suite forks (tests/conftest.py).
        env={**os.environ, PREFORK_ENV: "0"},
    )


def _cores_of(cpus_allowed: str) -> set[int]:
    """The cores of a Cpus_allowed_list such as "0", "0-1" or "0,2-3"."""
    cores: set[int] = set()
    for part in cpus_allowed.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def test_pinned_shards_report_aggregate_ratio_and_pinning(tmp_path):
    completed = _bench(tmp_path, "--pin-cores", str(CORES), *(f"--pin-sessions={count}" for count in SESSIONS),
                       "--json")
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = TogetherReport.model_validate_json(completed.stdout)

    cores = report.machine["cores_used"]
    assert len(cores) == CORES and set(cores) <= os.sched_getaffinity(0)
    shards = [process for process in report.pinned if process.name.startswith("shard-")]
    assert len(shards) == CORES
    # What the kernel said while they ran: each shard on exactly its own core, no two on the same one.
    assert [_cores_of(shard.cpus_allowed) for shard in shards] == [{core} for core in cores]
    baseline = next(process for process in report.pinned if process.name.startswith("baseline"))
    assert _cores_of(baseline.cpus_allowed) == {cores[0]}
    orchestrator = next(process for process in report.pinned if process.name.startswith("orchestrator"))
    assert orchestrator.pinned_to is None

    assert {side.path for side in report.baselines} == {"transformers generate()", "hearth LocalModel"}
    assert report.baseline_end_to_end_tokens_per_s > 0 and report.baseline_paths_agree
    # CPU time comes in clock ticks (10 ms): a tiny model's few tokens may cost none of them.
    assert all(side.cpu_ms_per_token >= 0 for side in report.baselines)
    assert [run.sessions for run in report.runs] == list(SESSIONS)
    for run in report.runs:
        assert run.tokens == run.sessions * NEW_TOKENS
        assert run.outputs_match_solo
        assert run.aggregate_tokens_per_s > 0
        assert run.ratio == pytest.approx(
            run.aggregate_tokens_per_s / (CORES * report.baseline_end_to_end_tokens_per_s))
        assert {"orchestrator", "nats-server", "bench client"} <= set(run.cpu_s)
        assert {f"shard {index}" for index in range(CORES)} <= set(run.cpu_s)
        assert run.paired_ratio is not None and len(run.baseline_around) == 2
        assert run.cpu_time_ratio >= 0 and all(seconds >= 0 for seconds in run.cpu_s.values())
    # One baseline run before the first mesh run and one after each, on the baseline's core.
    assert len(report.baseline_between) == len(report.runs) + 1
    assert len(report.targets) == len(SESSIONS)


def test_more_cores_than_available_is_refused_clearly(tmp_path):
    too_many = len(os.sched_getaffinity(0)) + 1
    completed = _bench(tmp_path, "--pin-cores", str(too_many))
    assert completed.returncode == 1
    assert f"--pin-cores {too_many} needs {too_many} cores" in completed.stderr
