"""`hearth bench` as a command: runs the Bench, prints the report on stdout and turns failures into an exit code."""

from __future__ import annotations

import logging
import sys

from services.bench.errors import BenchError
from services.bench.report import format_report
from services.bench.runner import Bench, BenchOptions
from services.cluster import ClusterError
from services.demo import DemoError
from services.random_models import UnknownRandomShape


def run_bench_command(options: BenchOptions, *, as_json: bool) -> int:
    """`hearth bench`: progress on stderr, the report (text or JSON) on stdout; 0 even when a target is missed."""
    # Progress and the report are this process's output; its library log lines (a NATS disconnect on
    # close) would only clutter them. The processes it starts log to files in their work directory.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    try:
        report = Bench(options).run()
    except (BenchError, ClusterError, DemoError, UnknownRandomShape) as error:
        print(f"hearth bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hearth bench: interrupted", file=sys.stderr)
        return 130
    print(report.model_dump_json(indent=2) if as_json else format_report(report))
    return 0
