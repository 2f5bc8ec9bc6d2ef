"""`hearth bench --json` end to end on a tiny random shape: every figure is present and describes the same run.

No speed is asserted here (BENCHMARKS.md holds the measured figures); the test checks that the bench
measures what it says: the same greedy tokens on both sides, one transport sample per hop and step, and
concurrent sessions that all run at once and finish.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hearth.services.devtools.bench.report import BenchReport
from hearth.services.devtools.local_cluster import BATCH_MERGE_WINDOW_ENV, shared_machine_batch_merge_window_ms
from hearth.services.devtools.random_models import RANDOM_MARKER_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 5
REPEATS = 2
# As many as the bench's mesh lets its one caller run at once: none of them waits in the queue.
SESSIONS = 4
SHARDS = 3
# More than the mesh runs at once (4): some wait in the queue.
BURST = 8

pytestmark = [pytest.mark.timeout(300), pytest.mark.scheduled_first]


def test_bench_json_report_on_a_random_tiny_shape(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "bench", "--model", "random:tiny", "--cache-dir", str(tmp_path),
         "--shards", str(SHARDS), "--prompt-tokens", "12", "--new-tokens", str(NEW_TOKENS), "--repeats", str(REPEATS),
         "--sessions", str(SESSIONS), "--torch-threads", "1", "--burst", str(BURST), "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = BenchReport.model_validate_json(completed.stdout)
    assert (tmp_path / "random-models" / "tiny" / RANDOM_MARKER_FILE).is_file()

    assert report.settings["prompt_tokens"] == 12  # the word-level tokenizer gives exactly the asked length
    # The shards share this machine's cores: the report says they merged decoding groups (and how long they wait).
    assert report.settings["shard_env"] == {BATCH_MERGE_WINDOW_ENV: repr(shared_machine_batch_merge_window_ms)}
    assert report.greedy_outputs_match and report.greedy_tokens_agreeing == NEW_TOKENS
    for side in (report.monolithic, report.pipeline):
        assert len(side.runs) == REPEATS
        assert all(run.tokens == NEW_TOKENS and run.decode_tokens_per_s > 0 for run in side.runs)
    assert all(run.construct_ms is not None and run.construct_ms > 0 for run in report.pipeline.runs)
    assert report.ratio_median > 0

    hops = [row for row in report.transport_decode if row.hop is not None]
    assert [row.hop for row in hops] == list(range(SHARDS))
    # Every measured decode step passed every hop once: (new tokens - 1) decode steps per run.
    assert all(row.steps == REPEATS * (NEW_TOKENS - 1) for row in hops)
    pooled = report.transport_decode[-1]
    assert pooled.shard_id == "all" and pooled.steps == SHARDS * REPEATS * (NEW_TOKENS - 1)
    assert pooled.p50_ms is not None and 0 < pooled.p50_ms <= pooled.p95_ms
    assert all(row.steps == REPEATS for row in report.transport_prefill if row.hop is not None)
    # A decode token's time, split: every part measured, none larger than the token, the head inside the turn.
    budget = report.token_budget
    assert budget is not None and budget.token_ms == pytest.approx(1000.0 / report.pipeline.decode_tokens_per_s_median)
    parts = (budget.hops_compute_ms, budget.hops_transport_ms, budget.orchestrator_turn_ms, budget.head_step_ms)
    assert all(part is not None and 0 < part < budget.token_ms for part in parts)
    assert budget.head_step_ms < budget.orchestrator_turn_ms
    assert budget.other_ms == pytest.approx(budget.token_ms - sum(parts[:3]))

    concurrent = report.concurrent
    assert concurrent is not None and len(concurrent.sessions) == SESSIONS
    assert all(session.tokens == NEW_TOKENS for session in concurrent.sessions)
    # The bench is one roster member, which never gets every running place: it has one place more than sessions.
    assert not any(session.first_token_after_another_finished for session in concurrent.sessions)
    assert concurrent.aggregate_tokens_per_s > 0
    assert concurrent.outputs_match_solo is True  # each session's tokens are generate()'s for its prompt alone
    assert concurrent.solo_tokens_agreeing == NEW_TOKENS
    # Every shard ran its decode steps through the continuous batcher: between one and SESSIONS rows per batch.
    assert set(concurrent.mean_batch_rows) == {row.shard_id for row in hops}
    assert all(1.0 <= rows <= SESSIONS for rows in concurrent.mean_batch_rows.values())
    # ... and on the CPU its short prefills too (one row each, or several prefilled together).
    assert set(concurrent.mean_prefill_batch_rows) == {row.shard_id for row in hops}
    assert all(1.0 <= rows <= SESSIONS for rows in concurrent.mean_prefill_batch_rows.values())
    assert concurrent.cache_events == {}  # the CPU captures no graphs, and every session fit the KV budget
    assert {check.target.split(" ")[0] for check in report.targets} >= {"decode", "per-hop", "pipeline", "burst:"}

    burst = report.burst
    assert burst is not None and burst.requests == BURST
    assert burst.completed == BURST and burst.refused == {} and burst.outputs_match_solo
    assert burst.largest_queue_position >= 1  # some waited, and were told their place
    assert 0 < burst.queue_wait_ms_p50 <= burst.queue_wait_ms_p95

    # Each shard's process memory beside its advertised need, and a shard's imports alone for the layers' part.
    assert len(report.shard_memory) == SHARDS
    assert all(shard.rss_mb and shard.peak_rss_mb >= shard.rss_mb and shard.rss_anonymous_mb
               for shard in report.shard_memory)
    assert report.shard_imports_memory is not None and report.shard_imports_memory.rss_mb > 0
