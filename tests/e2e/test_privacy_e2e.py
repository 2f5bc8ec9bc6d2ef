"""Privacy through a real mesh at DEBUG (nats-server, one shard host of the tiny model, an orchestrator, a projector,
`hearth gateway`): calls whose system prompt, user turns, earlier answer, stop string, tool and JSON schema carry a
marker, plus refused ones, leave the marker nowhere on disk: not in any process's log, the broker's JetStream store,
the read model, the event outboxes or any other file of the mesh's folder (docs/design.md, "Privacy")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, start_orchestrator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
MARKER = "ZQXJprivate"
HTTP_WAIT_S = 60


def _post(url: str, key: str, body: dict) -> int:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_WAIT_S) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_no_prompt_or_schema_reaches_a_log_or_a_file(tmp_path, tiny_models_dir):
    work_dir = tmp_path / "mesh"
    with LocalCluster(work_dir=work_dir, torch_threads=1, log_level="DEBUG") as cluster:
        cluster.start_nats()
        cluster.start_shard(str(tiny_models_dir / TINY_MODEL_NAME), 0, 5, node_id="host0", wait_ready=False)
        start_orchestrator(cluster, tiny_models_dir)
        cluster.start_projector(work_dir / "readmodel.db", wait_ready=False)
        cluster.wait_all_ready()
        key = create_api_key(cluster.member_key("alice", "client").parents[1], "alice")
        url = cluster.start_gateway().ready_file.read_text().strip()
        messages = [{"role": "system", "content": f"{MARKER} system"}, {"role": "user", "content": f"{MARKER} one"},
                    {"role": "assistant", "content": f"{MARKER} answer"}, {"role": "user", "content": f"{MARKER} two"}]
        call = {"model": TINY_MODEL_NAME, "max_tokens": 4, "temperature": 0, "messages": messages,
                "stop": [f"{MARKER}stop"]}
        tool = {"type": "function", "function": {"name": f"{MARKER}_tool", "description": MARKER, "parameters": {
            "type": "object", "properties": {f"{MARKER}_arg": {"type": "string"}}}}}
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {MARKER: {"enum": [f"{MARKER}value"]}}, "required": [MARKER]}}}
        answered = [_post(url, key, call), _post(url, key, {**call, "stream": True}),
                    _post(url, key, {**call, "tools": [tool]}), _post(url, key, {**call, "response_format": schema})]
        refused = [_post(url, key, {**call, "temperature": f"{MARKER}hot"}),
                   _post(url, key, {**call, "messages": [{"role": "user", "content": f"{MARKER} " * 2000}]}),
                   _post(url, key, {**call, "response_format": {"type": "json_schema", "json_schema": {
                       "name": "s", "schema": {"type": "object", "properties": {"a": {"type": MARKER}}}}}})]
        assert answered == [200] * 4 and refused == [400] * 3
    # Every process is stopped: its log, the broker's store and the databases are complete.
    holding = [str(path.relative_to(work_dir)) for path in work_dir.rglob("*")
               if path.is_file() and MARKER.encode() in path.read_bytes()]
    assert holding == []
