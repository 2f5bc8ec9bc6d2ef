"""`hearth bench` as a command: runs the Bench, prints the report on stdout and turns failures into an exit code."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from pydantic import BaseModel

from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.report import format_report
from hearth.services.devtools.bench.runner import Bench, BenchOptions
from hearth.services.devtools.bench.together import TogetherBench, TogetherOptions
from hearth.services.devtools.bench.together_report import format_together_report
from hearth.services.devtools.local_cluster import ClusterError
from hearth.services.devtools.demo import DemoError
from hearth.services.devtools.random_models import UnknownRandomShape


def run_bench_command(options: BenchOptions, *, as_json: bool) -> int:
    """`hearth bench`: progress on stderr, the report (text or JSON) on stdout; 0 even when a target is missed."""
    return _run(lambda: Bench(options).run(), format_report, as_json=as_json)


def run_together_command(options: TogetherOptions, *, as_json: bool) -> int:
    """`hearth bench --pin-cores N`, reported like `hearth bench`."""
    return _run(lambda: TogetherBench(options).run(), format_together_report, as_json=as_json)


def _run(measure: Callable[[], BaseModel], format_text: Callable, *, as_json: bool) -> int:
    # Progress and the report are this process's output; its library log lines (a NATS disconnect on
    # close) would only clutter them. The processes it starts log to files in their work directory.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    try:
        report = measure()
    except (BenchError, ClusterError, DemoError, UnknownRandomShape) as error:
        print(f"hearth bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hearth bench: interrupted", file=sys.stderr)
        return 130
    print(report.model_dump_json(indent=2) if as_json else format_text(report))
    return 0
