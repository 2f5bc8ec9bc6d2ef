"""The dashboards' PromQL evaluated by promtool on series shaped like a real mesh's: every process that projects the
event log (the projector, each orchestrator's routing read model) counts the same rejected event, so a panel must
not add them up. Skips, saying so, where promtool is not installed (`make tools`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hearth.services.dashboards.model import PromPanel
from hearth.services.dashboards.panels import DASHBOARDS

# Where `make tools` unpacks Debian's prometheus package (the venv's tools folder), else PATH.
PROMTOOL = Path(sys.executable).parent.parent / "tools" / "prometheus" / "usr" / "bin" / "promtool"
scrape_interval = "15s"


def promtool() -> str:
    found = str(PROMTOOL) if PROMTOOL.is_file() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (`make tools` unpacks Debian's prometheus package into the venv)")
    return found


def expression(legend: str) -> str:
    return next(target.expr for dashboard in DASHBOARDS for panel in dashboard.panels
                if isinstance(panel, PromPanel) for target in panel.targets if target.legend == legend)


def evaluate(tmp_path: Path, series: dict[str, str], expr: str, expected: list[dict]) -> subprocess.CompletedProcess:
    """promtool's unit test of `expr` at 4m over `series` (series -> promtool values), expecting `expected`."""
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": scrape_interval,
        "input_series": [{"series": name, "values": values} for name, values in series.items()],
        "promql_expr_test": [{"expr": expr, "eval_time": "4m", "exp_samples": expected}],
    }]}
    path = tmp_path / "dashboard_test.yml"
    path.write_text(yaml.safe_dump(tests))
    return subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_rejected_events_are_shown_once_however_many_processes_project_the_log(tmp_path):
    # One event rejected a second, seen by the projector and by the orchestrator's routing projection alike.
    series = {f'hearth_events_rejected_total{{job="{job}",instance="{job}:9100",reason="unsigned"}}': "0+15x20"
              for job in ("hearth-projector", "hearth-orchestrator")}
    completed = evaluate(tmp_path, series, expression("rejected {{reason}}"),
                         [{"labels": '{reason="unsigned"}', "value": 1}])
    assert completed.returncode == 0, completed.stdout + completed.stderr
