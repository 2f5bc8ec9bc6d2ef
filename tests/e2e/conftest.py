"""Fixtures for end-to-end tests: tiny checkpoints and a LocalCluster of real hearth processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hearth.services.devtools.local_cluster import LocalCluster
from hearth.services.broker.connection import connect_nats
from hearth.services.client.chat import ChatResult, chat
from hearth.protocol.chat import ChatRequest
from tests.unit.inference_tiny_models import write_tiny_model

TINY_MODEL_NAME = "tiny-llama"
TINY_LAYERS = 6
# `hearth weights publish` of a tiny checkpoint into a test broker's store.
PUBLISH_TIMEOUT_S = 120
THREE_SHARD_RANGES = [(0, 1), (2, 3), (4, 5)]
# Long enough positions for the 600-token prompt test.
TINY_CONTEXT_LENGTH = 1024


# How much of each process's log a failed test shows.
FAILED_TEST_LOG_CHARS = 6000


def _clusters_of(item: pytest.Item) -> list[LocalCluster]:
    """The LocalClusters a test's fixtures hold (directly, or as a mesh's `cluster`)."""
    found: list[LocalCluster] = []
    for value in getattr(item, "funcargs", {}).values():
        cluster = value if isinstance(value, LocalCluster) else getattr(value, "cluster", None)
        if isinstance(cluster, LocalCluster) and cluster not in found:
            found.append(cluster)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """A failed test shows the log tails of its mesh's processes beside it (a module's mesh prints them only when
    the module ends, under whichever test ran last)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for cluster in _clusters_of(item):
        for process in cluster.processes:
            report.sections.append((f"log of {process.name}", process.log_tail(FAILED_TEST_LOG_CHARS)))


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """A folder holding `tiny-llama` (6 layers) as a real checkpoint: processes load it by name or path."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(folder / TINY_MODEL_NAME, "llama", max_position_embeddings=TINY_CONTEXT_LENGTH)
    return folder


@pytest.fixture(scope="session")
def tiny_model_path(tiny_models_dir) -> Path:
    return tiny_models_dir / TINY_MODEL_NAME


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:
    """An empty LocalCluster with its own nats-server; every process it starts is stopped at the end."""
    with LocalCluster(work_dir=tmp_path / "cluster", torch_threads=1) as local_cluster:
        local_cluster.start_nats()
        try:
            yield local_cluster
        finally:
            # Dump process logs on failure for diagnosis (pytest shows captured output of failed tests).
            for process in local_cluster.processes:
                print(f"----- {process.name} -----\n{process.log_tail(4000)}")


def start_three_shards(cluster: LocalCluster, model_path: Path, *, node_prefix: str = "host",
                       extra_args: list[str] = ()) -> list:
    shards = [
        cluster.start_shard(str(model_path), lo, hi, node_id=f"{node_prefix}{index}", extra_args=list(extra_args),
                            wait_ready=False)
        for index, (lo, hi) in enumerate(THREE_SHARD_RANGES)
    ]
    return shards


@contextlib.contextmanager
def three_shard_mesh(work_dir: Path, models_dir: Path, *, nats_options: dict | None = None,
                     orchestrator_args: list[str] = (), projector_db: Path | None = None,
                     **cluster_options) -> Iterator[LocalCluster]:
    """A ready mesh of real processes: nats-server, 3 shard hosts of the tiny model, an orchestrator (and a
    projector given `projector_db`); the processes' logs are printed when it closes (shown for failed tests)."""
    with LocalCluster(work_dir=work_dir, torch_threads=1, **cluster_options) as mesh:
        mesh.start_nats(**(nats_options or {}))
        start_three_shards(mesh, models_dir / TINY_MODEL_NAME)
        start_orchestrator(mesh, models_dir, extra_args=list(orchestrator_args))
        if projector_db is not None:
            mesh.start_projector(projector_db)
        try:
            mesh.wait_all_ready()
            yield mesh
        finally:
            for process in mesh.processes:
                print(f"----- {process.name} -----\n{process.log_tail(3000)}")


def start_orchestrator(cluster: LocalCluster, models_dir: Path, *, extra_args: list[str] = (),
                       wait_ready: bool = False, env: dict[str, str] | None = None, model_name: str = TINY_MODEL_NAME):
    """The orchestrator of `cluster` serving `model_name` of `models_dir` (the tiny model); `env`: settings for it
    alone (read when it starts)."""
    before = dict(cluster.extra_env)
    cluster.extra_env.update(env or {})
    try:
        return cluster.start_orchestrator(
            extra_args=["--models-dir", str(models_dir), "--preload", model_name, *extra_args],
            wait_ready=wait_ready,
        )
    finally:
        cluster.extra_env.clear()
        cluster.extra_env.update(before)


async def chat_once(cluster: LocalCluster, request: ChatRequest) -> ChatResult:
    """One call through `cluster` on a client connection of its own."""
    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        return await chat(nc, request)
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


@pytest.fixture
async def client(cluster) -> AsyncIterator:
    nc = await connect_nats(cluster.nats_url, name="e2e-client", settings=cluster.nats_settings())
    try:
        yield nc
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


def publish_to_store(cluster: LocalCluster, path: Path, name: str) -> None:
    """`hearth weights publish PATH --name NAME` into `cluster`'s store, as its system user; checked to succeed."""
    publish = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "weights", "publish", str(path), "--name", name,
         "--nats", cluster.nats_url],
        env={**os.environ, **cluster.credentials_env(cluster.system_creds)}, capture_output=True, text=True,
        timeout=PUBLISH_TIMEOUT_S, cwd=Path(__file__).resolve().parents[2])
    assert publish.returncode == 0, publish.stderr
    assert f"--model store:{name}" in publish.stdout


def greedy_reference(path, prompt: str, new_tokens: int) -> list[int]:
    """transformers' own greedy generate() of `new_tokens` after `prompt` on the checkpoint at `path` (float32): the
    tokens a mesh of its layers must give."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return output[0, len(input_ids):].tolist()
