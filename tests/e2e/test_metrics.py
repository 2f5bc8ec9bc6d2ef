"""Every long-running process's /metrics on a live mesh: `promtool check metrics` finds nothing to say, the names
the dashboards are built on are there with data after a request, and a real Prometheus scraping the mesh answers
every PromQL expression of the dashboards (grafana/dashboards/*.json) and of our core list with data.

promtool and prometheus come from Debian's `prometheus` package (`make tools`, run by `make test`); the tests skip,
saying so, where it could not be fetched.
"""

from __future__ import annotations

import asyncio
import re
from urllib.parse import urlparse

import pytest

from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh
from tests.e2e.prometheus_support import (
    CORE_EXPRESSIONS,
    PrometheusServer,
    dashboard_expressions,
    metric_families,
    promtool_problems,
    scrape,
    tool,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ORCHESTRATOR_METRICS = {
    "hearth_pipeline_construct_seconds", "hearth_first_token_seconds", "hearth_decode_tokens_per_second",
    "hearth_shard_latency_seconds", "hearth_failovers_total", "hearth_fallback_to_local_total",
    "hearth_shard_corruption_detected_total", "hearth_requests_total", "hearth_calls_in_flight",
    "hearth_calls_total", "hearth_calls_refused_total", "hearth_integrity_failures_total",
    "hearth_orchestrator_turn_seconds", "hearth_head_step_seconds",
}
SHARD_METRICS = {
    "hearth_shard_step_compute_seconds", "hearth_shard_step_transport_seconds", "hearth_shard_active_sessions",
    "hearth_shard_kv_cache_bytes", "hearth_shard_tokens_served_total", "hearth_activation_frames_refused_total",
}
PROJECTOR_METRICS = {
    "hearth_projector_events_applied_total", "hearth_events_rejected_total", "hearth_projector_lag_events",
    "hearth_projector_lag_seconds",
}
# Generous: a scrape every second, a rate needs two of them after the request.
data_timeout_s = 30.0


def role_of(process_name: str) -> str:
    return process_name.split("-", 1)[0]


@pytest.fixture(scope="module")
def metrics_mesh(tmp_path_factory, tiny_models_dir):
    """Three shards, an orchestrator and a projector, each serving /metrics on a port of its own."""
    work_dir = tmp_path_factory.mktemp("metrics-mesh")
    with three_shard_mesh(work_dir, tiny_models_dir, projector_db=work_dir / "readmodel.sqlite") as mesh:
        yield mesh


async def run_requests(mesh, count: int = 1) -> None:
    nc = await connect_nats(mesh.nats_url, name="metrics-test", settings=mesh.nats_settings())
    try:
        for index in range(count):
            result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=f"count to {index + 3}", max_tokens=6))
            assert result.ok, result.final
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


async def test_every_endpoint_is_promtool_clean_and_carries_its_metrics(metrics_mesh):
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool not found: `make tools` unpacks Debian's prometheus package into .venv/tools")
    await run_requests(metrics_mesh)
    urls = metrics_mesh.metrics_urls()
    assert sorted(role_of(name) for name in urls) == ["orchestrator", "projector", "shard", "shard", "shard"]
    expected = {"orchestrator": ORCHESTRATOR_METRICS, "shard": SHARD_METRICS, "projector": PROJECTOR_METRICS}
    for name, url in urls.items():
        text = await asyncio.to_thread(scrape, url)
        assert promtool_problems(promtool, text) == "", f"{name} ({url})"
        missing = expected[role_of(name)] - metric_families(text)
        assert not missing, f"{name} lacks {sorted(missing)}"
        if role_of(name) == "orchestrator":
            assert 'hearth_requests_total{code="ok"} 1.0' in text
            assert "hearth_first_token_seconds_count 1.0" in text
            hop_steps = re.findall(r'^hearth_shard_latency_seconds_count\{shard_id="[^"]+"\} (\S+)$', text, re.M)
            assert len(hop_steps) == 3 and all(float(count) > 0 for count in hop_steps), hop_steps
        elif role_of(name) == "shard":
            served = re.findall(r'^hearth_shard_tokens_served_total\{shard_id="[^"]+"\} (\S+)$', text, re.M)
            assert len(served) == 1 and float(served[0]) > 0, served


async def test_prometheus_answers_every_dashboard_expression_with_data(metrics_mesh, tmp_path):
    binary = tool("prometheus")
    if binary is None:
        pytest.skip("prometheus not found: `make tools` unpacks Debian's prometheus package into .venv/tools")
    targets: dict[str, list[str]] = {}
    for name, url in metrics_mesh.metrics_urls().items():
        targets.setdefault(role_of(name), []).append(urlparse(url).netloc)
    expressions = [("core", expr) for expr in CORE_EXPRESSIONS] + dashboard_expressions()
    server = PrometheusServer(binary, tmp_path / "prometheus", targets).start()
    try:
        await asyncio.to_thread(server.wait_all_targets_up)
        await run_requests(metrics_mesh, count=2)
        failures = []
        for where, expr in expressions:
            answer = await asyncio.to_thread(server.wait_for_data, expr, data_timeout_s)
            if answer.get("status") != "success" or not answer["data"]["result"]:
                failures.append(f"{where}: {expr}\n  -> {answer}")
        assert not failures, "expressions without data:\n" + "\n".join(failures)
    finally:
        server.stop()
