"""Helpers of the metrics tests: Debian's promtool and prometheus binaries (`make tools`), scraping /metrics, a real
Prometheus server over a live mesh, and the PromQL expressions to check (the dashboards' and our own core list)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hearth.services.broker.listen_ports import free_tcp_port

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where `make tools` unpacks Debian's prometheus package: the checkout's venv (it may be a link shared by worktrees),
# else the venv running the tests (a worktree without a .venv of its own).
TOOLS_BINS = tuple(venv / "tools" / "prometheus" / "usr" / "bin"
                   for venv in (REPO_ROOT / ".venv", Path(sys.executable).parent.parent))
DASHBOARDS_DIR = REPO_ROOT / "grafana" / "dashboards"
poll_interval_s = 0.25
http_timeout_s = 5.0
# Grafana's own variables, as a dashboard query over the last minutes would see them.
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}

# What the dashboards are built on (docs/metrics.md): each must return data once a request has run.
CORE_EXPRESSIONS = (
    "sum(rate(hearth_requests_total[1m]))",
    "sum by (code) (increase(hearth_requests_total[1m]))",
    "histogram_quantile(0.95, sum by (le) (rate(hearth_first_token_seconds_bucket[1m])))",
    "histogram_quantile(0.5, sum by (le) (rate(hearth_pipeline_construct_seconds_bucket[1m])))",
    "histogram_quantile(0.5, sum by (le) (rate(hearth_decode_tokens_per_second_bucket[1m])))",
    "histogram_quantile(0.95, sum by (le, shard_id) (rate(hearth_shard_latency_seconds_bucket[1m])))",
    "sum by (reason) (rate(hearth_failovers_total[1m]))",
    "sum(rate(hearth_fallback_to_local_total[1m]))",
    "sum by (shard_id, check) (rate(hearth_shard_corruption_detected_total[1m]))",
    "sum(hearth_calls_in_flight)",
    "sum by (caller) (rate(hearth_calls_total[1m]))",
    "sum by (reason) (rate(hearth_calls_refused_total[1m]))",
    "sum by (shard_id) (hearth_shard_active_sessions)",
    "sum by (shard_id) (hearth_shard_kv_cache_bytes)",
    "sum by (shard_id) (rate(hearth_shard_tokens_served_total[1m]))",
    "histogram_quantile(0.95, sum by (le, shard_id, kind) (rate(hearth_shard_step_compute_seconds_bucket[1m])))",
    "histogram_quantile(0.95, sum by (le, shard_id) (rate(hearth_shard_step_transport_seconds_bucket[1m])))",
    "sum by (reason) (rate(hearth_activation_frames_refused_total[1m]))",
    "sum by (check, checked_at) (rate(hearth_integrity_failures_total[1m]))",
    "sum by (event_type) (rate(hearth_projector_events_applied_total[1m]))",
    "max(hearth_projector_lag_events)",
    "max(hearth_projector_lag_seconds)",
    "sum by (reason) (rate(hearth_events_rejected_total[1m]))",
)


def tool(name: str) -> Path | None:
    """`promtool` or `prometheus` from `make tools`, else from PATH; None when neither has it."""
    for tools_bin in TOOLS_BINS:
        if (tools_bin / name).is_file():
            return tools_bin / name
    found = shutil.which(name)
    return Path(found) if found else None


def scrape(url: str, timeout_s: float = 30.0) -> str:
    """The text of one /metrics endpoint, waiting for it to answer (a projector serves once it has started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=http_timeout_s) as response:
                return response.read().decode()
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(poll_interval_s)


def metric_families(text: str) -> set[str]:
    """The names of the families an exposition declares (`# TYPE name kind`; counters keep `_total`)."""
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def promtool_problems(promtool: Path, text: str) -> str:
    """What `promtool check metrics` says about an exposition (empty when it is clean)."""
    checked = subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=30)
    said = (checked.stdout + checked.stderr).strip()
    return said if checked.returncode != 0 or said else ""


# ------------------------------------------------------------------ the dashboards' expressions

def _substitute_variables(expr: str) -> str:
    """The expression with Grafana variables filled in: intervals by GRAFANA_INTERVALS, a label matcher on any
    other variable by "any value"."""
    def interval(match: re.Match) -> str:
        return GRAFANA_INTERVALS.get(match.group(1) or match.group(2), match.group(0))

    expr = re.sub(r"\$\{(__\w+)\}|\$(__\w+)", interval, expr)
    return re.sub(r'(\w+)\s*(?:=~|=|!=|!~)\s*"[^"]*\$\{?\w+(?::\w+)?\}?[^"]*"', r'\1=~".*"', expr)


def _is_prometheus(datasource) -> bool:
    if datasource is None:
        return True  # Grafana's default datasource: the provisioned Prometheus
    if isinstance(datasource, dict):
        kind = datasource.get("type")
        return kind is None or kind == "prometheus" or "prometheus" in str(datasource.get("uid", "")).lower()
    return "sql" not in str(datasource).lower()


def _targets(node, inherited=None) -> Iterator[tuple[dict, object]]:
    if isinstance(node, dict):
        datasource = node.get("datasource", inherited)
        for target in node.get("targets", []) or []:
            yield target, target.get("datasource") or datasource
        for key in ("panels", "rows"):
            for child in node.get(key, []) or []:
                yield from _targets(child, datasource)


def dashboard_expressions(directory: Path = DASHBOARDS_DIR) -> list[tuple[str, str]]:
    """(where, PromQL) of every Prometheus target of every dashboard in `directory`, variables filled in."""
    found = []
    for path in sorted(directory.glob("*.json")):
        dashboard = json.loads(path.read_text())
        dashboard = dashboard.get("dashboard", dashboard)
        for target, datasource in _targets(dashboard):
            expr = target.get("expr")
            if expr and _is_prometheus(datasource):
                found.append((f"{path.name} ref {target.get('refId', '?')}", _substitute_variables(expr)))
    return found


# ------------------------------------------------------------------ a real Prometheus

class PrometheusServer:
    """`prometheus` scraping the given /metrics URLs every second, with its storage in `work_dir`."""

    def __init__(self, binary: Path, work_dir: Path, targets: dict[str, list[str]]) -> None:
        self.binary = binary
        self.work_dir = work_dir
        self.targets = targets  # job -> ["127.0.0.1:port", ...]
        self.port = free_tcp_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def config(self) -> str:
        jobs = [{"job_name": job, "metrics_path": "/metrics", "static_configs": [{"targets": addresses}]}
                for job, addresses in self.targets.items()]
        # JSON is YAML: no YAML library needed.
        return json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                                      "scrape_timeout": "1s"}, "scrape_configs": jobs}, indent=2)

    def start(self, ready_timeout_s: float = 60.0) -> "PrometheusServer":
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "prometheus.yml"
        config_path.write_text(self.config())
        log = open(self.work_dir / "prometheus.log", "wb")
        self._process = subprocess.Popen(
            [str(self.binary), f"--config.file={config_path}", f"--storage.tsdb.path={self.work_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._wait(self._ready, ready_timeout_s, "Prometheus did not become ready")
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (self.work_dir / "prometheus.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_all_targets_up(self, timeout_s: float = 60.0) -> None:
        expected = sum(len(addresses) for addresses in self.targets.values())

        def all_up() -> bool:
            answer = self._get_json("/api/v1/targets")
            active = answer["data"]["activeTargets"] if answer else []
            return len(active) == expected and all(target["health"] == "up" for target in active)

        self._wait(all_up, timeout_s, f"not every target is up: {self._get_json('/api/v1/targets')}")

    def query(self, expr: str) -> dict:
        """The answer of /api/v1/query (status, data.result), or an error answer naming what went wrong."""
        answer = self._get_json("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        return answer or {"status": "error", "error": "no answer"}

    def wait_for_data(self, expr: str, timeout_s: float) -> dict:
        """The first answer to `expr` that carries data (or the last one, when none did within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.query(expr)
            if answer.get("status") != "success" or answer["data"]["result"] or time.monotonic() > deadline:
                return answer
            time.sleep(poll_interval_s)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=15)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/-/ready", timeout=http_timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=http_timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            return error.read()  # a bad query answers 400 with a JSON body saying why
        except (urllib.error.URLError, ConnectionError):
            return None

    def _get_json(self, path: str) -> dict | None:
        body = self._get(path)
        try:
            return json.loads(body) if body else None
        except ValueError:
            return None

    def _wait(self, condition, timeout_s: float, message: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self._process is not None and self._process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self._process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{message}\n{self.log_tail()}")
            time.sleep(poll_interval_s)
