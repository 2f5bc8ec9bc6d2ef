"""`hearth bench`'s memory figures: a process's resident memory read from /proc, joined to the shards' advertised
needs, and shown in the text report beside them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hearth.services.common.hearth_files import SOURCES_ROOT
from hearth.services.devtools.bench.process_stats import SHARD_IMPORTS_PROBE, resident_memory
from hearth.services.devtools.prefork import HEARTH_MODULE
from hearth.services.devtools.bench.report import (
    BenchReport,
    ImportsMemory,
    ShardMemory,
    Side,
    format_report,
    with_resident_memory,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def finished_pid() -> int:
    """The id of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_resident_memory_grows_with_what_the_process_allocates():
    before = resident_memory(os.getpid())
    ballast = bytearray(64 * 1024 * 1024)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page so it is resident
    after = resident_memory(os.getpid())
    assert after.anonymous_mb - before.anonymous_mb >= 60
    assert after.rss_mb == pytest.approx(after.anonymous_mb + after.file_mb, abs=1.0)
    assert after.peak_rss_mb >= after.rss_mb > 0
    del ballast


def test_the_imports_baseline_holds_what_a_shard_process_runs_on():
    # A shard runs as `python -m <HEARTH_MODULE> shard` on uvloop's loop: a baseline without the CLI's modules (some
    # 3 MiB) or uvloop would count them as its layers'.
    listing = SHARD_IMPORTS_PROBE + "\nimport sys\nprint(json.dumps(sorted(sys.modules)))"
    finished = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, cwd=SOURCES_ROOT,
                              timeout=120, check=True)
    modules = set(json.loads(finished.stdout.strip().splitlines()[-1]))
    assert {HEARTH_MODULE, "hearth.services.shard.main", "transformers.models.llama.modeling_llama"} <= modules
    assert "uvloop" in modules or importlib.util.find_spec("uvloop") is None


def test_shard_figures_gain_their_processes_memory_and_a_gone_process_keeps_its_advert():
    adverts = [ShardMemory(shard_id="m:0-1@a", device="cpu", memory_required_mb=12.5),
               ShardMemory(shard_id="m:2-3@b", device="cpu", memory_required_mb=10.0),
               ShardMemory(shard_id="m:4-5@c", device="cpu", memory_required_mb=8.0)]
    measured = with_resident_memory(adverts, {"m:0-1@a": os.getpid(), "m:2-3@b": finished_pid()})
    assert [each.memory_required_mb for each in measured] == [12.5, 10.0, 8.0]
    live, gone, unknown = measured
    assert live.rss_mb > 0 and live.peak_rss_mb >= live.rss_mb
    assert live.rss_anonymous_mb > 0 and live.rss_file_mb is not None
    assert gone.rss_mb is None and unknown.rss_mb is None and unknown.peak_rss_mb is None


def minimal_report(shard_memory: list[ShardMemory], imports: ImportsMemory | None) -> BenchReport:
    side = Side(runs=[], decode_tokens_per_s_median=10.0, ttft_ms_median=50.0)
    return BenchReport(
        started_at="now", machine={"cpus": 2, "torch": "x"},
        model={"spec": "random:tiny", "layers": 6, "parameters": 1e6, "dtype": "float32"},
        settings={"device": "cpu", "dtype": "checkpoint's", "quantization": "int4/g64", "shards": 3,
                  "layer_ranges": [(0, 1), (2, 3), (4, 5)], "prompt_tokens": 12, "new_tokens": 4, "repeats": 1},
        monolithic=side, pipeline=side, greedy_outputs_match=True, ratio_median=1.0, ratio_of_medians=1.0,
        pipeline_overhead_ms_per_token=0.0, construct_ms_p50=None, construct_ms_max=None, transport_decode=[],
        transport_prefill=[], concurrent=None, targets=[], shard_memory=shard_memory, shard_imports_memory=imports)


def test_text_report_shows_each_shards_rss_beside_its_advertised_need():
    shards = [ShardMemory(shard_id="m:0-1@a", device="cpu", memory_required_mb=12.5, rss_mb=401.2,
                          peak_rss_mb=455.0, rss_anonymous_mb=300.1, rss_file_mb=101.1),
              ShardMemory(shard_id="m:2-3@b", device="cpu", memory_required_mb=10.0)]
    text = format_report(minimal_report(shards, ImportsMemory(rss_mb=348.8, rss_anonymous_mb=261.5,
                                                              rss_file_mb=87.3)))
    row_a = next(line for line in text.splitlines() if line.strip().startswith("m:0-1@a"))
    assert row_a.split()[1:] == ["cpu", "12.5", "401.2", "300.1", "101.1", "455.0"]
    row_b = next(line for line in text.splitlines() if line.strip().startswith("m:2-3@b"))
    assert row_b.split()[1:] == ["cpu", "10.0", "-", "-", "-", "-"]
    assert "int4/g64" in text and "imports alone (no weights): RSS 348.8" in text


def test_report_json_round_trips_the_memory_fields_and_reads_reports_from_before_them():
    report = minimal_report([ShardMemory(shard_id="m:0-5@a", device="cpu", memory_required_mb=3.0, rss_mb=350.0,
                                         peak_rss_mb=360.0, rss_anonymous_mb=270.0, rss_file_mb=80.0)],
                            ImportsMemory(rss_mb=340.0, rss_anonymous_mb=260.0, rss_file_mb=80.0))
    again = BenchReport.model_validate_json(report.model_dump_json())
    assert again.shard_memory == report.shard_memory and again.shard_imports_memory == report.shard_imports_memory
    older = report.model_dump(mode="json")
    del older["shard_imports_memory"]
    for figures in older["shard_memory"]:
        for key in ("rss_mb", "peak_rss_mb", "rss_anonymous_mb", "rss_file_mb"):
            del figures[key]
    old = BenchReport.model_validate(older)
    assert old.shard_imports_memory is None and old.shard_memory[0].rss_mb is None
    assert "m:0-5@a" in format_report(old)
