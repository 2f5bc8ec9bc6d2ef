"""Freed heap goes back to the OS (hearth/inference/heap.py): fragments glibc keeps resident after a large block
raised its mmap threshold leave the process's RSS once released, and a CPU shard releases them whenever a session's
caches are dropped (reset, ended keeping a prefix, evicted idle), not on every step, and an orchestrator computing
on the CPU releases them when its last running call ends."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from hearth.inference import load_head, load_layer_range
from hearth.inference.compute_thread import COMPUTE_THREAD_NAME
from hearth.inference.heap import _glibc
from hearth.protocol.control import PrefixBlocks
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator import catalog as orchestrator_catalog
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.orchestrator.service import Orchestrator
from hearth.services.shard import compute as shard_compute
from hearth.services.shard.compute import ShardCompute
from hearth.services.transport import FrameKind
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401
from .test_layer_slices import _open_hop, _received, shard_settings

MIB = 1 << 20

# Loading frees large blocks, which raises glibc's mmap threshold to their size (up to 32 MiB), so blocks below it are
# then served from the arena; a live block above them keeps the arena's top in use, so only a release hands their
# pages back.
_FRAGMENTS = """
import json, torch
from hearth.inference.heap import release_freed_heap
def rss_mib():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
large = torch.ones(24 << 20, dtype=torch.uint8)
del large
start = rss_mib()
blocks = [torch.ones(512 << 10, dtype=torch.uint8) for _ in range(120)]
pin = torch.ones(640 << 10, dtype=torch.uint8)
del blocks
freed = rss_mib()
release_freed_heap()
print(json.dumps({"start": start, "freed": freed, "released": rss_mib()}))
"""


@pytest.mark.skipif(_glibc() is None, reason="the C library has no malloc_trim (not glibc on Linux)")
def test_freed_fragments_leave_the_resident_memory_once_released():
    finished = subprocess.run([sys.executable, "-c", _FRAGMENTS], capture_output=True, text=True, timeout=120,
                              check=True)
    figures = json.loads(finished.stdout.strip().splitlines()[-1])
    assert figures["freed"] - figures["start"] > 40, figures  # freed, yet still resident
    assert figures["freed"] - figures["released"] > 40, figures


# A process that has loaded layers (or a head) on the CPU; then a worker thread reads a file in 8 MiB chunks, as a
# shard hashes its checkpoint, and releases the heap when done, as weights_sha256 does: the chunks come from that
# thread's arena and, freed, join its top, which glibc's malloc_trim leaves resident (it trims only the main arena's
# top) and free() hands back only past a trim threshold that loading raised.
_THREAD_TOP = """
import json, sys, threading
from hearth.inference import load_head, load_layer_range
from hearth.inference.heap import release_freed_heap
def rss_mib():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
if sys.argv[2] == "head":
    loaded = load_head(sys.argv[1], load_tokenizer=False)
else:
    loaded = load_layer_range(sys.argv[1], 0, 0, cache_budget_bytes=1 << 20, session_ttl_s=60.0)
figures = {}
def read_in_chunks():
    large = bytearray(24 << 20)
    del large
    chunks = [b"\\1" * (8 << 20) for _ in range(3)]
    del chunks
    figures["freed"] = rss_mib()
    release_freed_heap()
figures["start"] = rss_mib()
thread = threading.Thread(target=read_in_chunks)
thread.start()
thread.join()
figures["released"] = rss_mib()
print(json.dumps(figures))
"""


@pytest.mark.skipif(_glibc() is None, reason="the C library has no malloc_trim (not glibc on Linux)")
@pytest.mark.parametrize("loaded", ["layers", "head"])
def test_blocks_freed_at_the_top_of_a_threads_arena_leave_the_resident_memory_when_it_releases(tiny_model_dir,
                                                                                                 loaded):
    finished = subprocess.run([sys.executable, "-c", _THREAD_TOP, str(tiny_model_dir("llama")), loaded],
                              capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(finished.stdout.strip().splitlines()[-1])
    assert figures["freed"] - figures["start"] > 16, figures  # kept while the thread computes
    assert figures["released"] - figures["start"] < 4, figures


async def test_a_cpu_shard_releases_the_heap_when_a_sessions_caches_are_dropped(tiny_model_dir, monkeypatch):
    releases = []
    monkeypatch.setattr(shard_compute, "release_freed_heap", lambda: releases.append(1))
    path = tiny_model_dir("llama")
    head = load_head(path)
    now = [0.0]
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, cache_budget_bytes=RUNNER_KV_LIMITS["cache_budget_bytes"],
                              session_ttl_s=60.0, prefix_ttl_s=600.0, clock=lambda: now[0])
    compute = ShardCompute(runner, "shard-0", shard_settings())
    hop = _open_hop("s", TINY_NUM_LAYERS - 1)

    async def prefill_and_decode(session_id: str) -> None:
        await compute.run(_open_hop(session_id, TINY_NUM_LAYERS - 1),
                          _received(session_id, FrameKind.prefill, 0, head.embed(list(range(5, 13)))))
        await compute.run(_open_hop(session_id, TINY_NUM_LAYERS - 1),
                          _received(session_id, FrameKind.decode, 8, head.embed([13])))

    await prefill_and_decode("s")
    assert releases == []  # steps leave the heap alone
    await compute.reset(_open_hop("s", TINY_NUM_LAYERS - 1))
    assert len(releases) == 1
    # A hop closed before any step (a member may open and close its hops as fast as it likes): nothing dropped, and
    # no malloc_trim on the compute thread, where every member's steps run.
    await compute.reset(_open_hop("never-ran", TINY_NUM_LAYERS - 1))
    assert len(releases) == 1

    await prefill_and_decode("s")
    assert await compute.end_session(hop, PrefixBlocks(block_tokens=4, hashes=["a" * 32, "b" * 32]), None) == 8
    assert len(releases) == 2
    assert await compute.evict_idle() == 0
    assert len(releases) == 2  # nothing dropped, nothing released

    await prefill_and_decode("idle")
    now[0] += 61.0
    assert await compute.evict_idle() == 1
    assert len(releases) == 3


async def test_an_orchestrator_releases_the_heap_on_its_compute_thread_when_its_last_running_call_ends(monkeypatch):
    threads = []
    monkeypatch.setattr(orchestrator_catalog, "release_freed_heap",
                        lambda: threads.append(threading.current_thread().name))
    orchestrator = Orchestrator(MagicMock(), HearthSettings(), node_id="orchestrator-heap")
    orchestrator.catalog.use_compute(torch.device("cpu"), torch.float32)
    orchestrator.context = SimpleNamespace(running_calls=0)
    first_ends, second_ends = asyncio.Event(), asyncio.Event()

    async def call(ends: asyncio.Event) -> None:
        async with orchestrator._counted_as_running():
            await ends.wait()
        await orchestrator._release_heap_when_idle()

    first = asyncio.create_task(call(first_ends))
    second = asyncio.create_task(call(second_ends))
    await asyncio.sleep(0)
    first_ends.set()
    await first
    assert threads == []  # another call still runs
    second_ends.set()
    await second
    assert threads == [COMPUTE_THREAD_NAME + "_0"]

    cancelled = asyncio.create_task(call(asyncio.Event()))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert len(threads) == 1  # a cancelled call (shutdown) does not wait for the compute thread


async def test_an_orchestrator_computing_on_a_gpu_leaves_the_c_heap_alone(monkeypatch):
    releases = []
    monkeypatch.setattr(orchestrator_catalog, "release_freed_heap", lambda: releases.append(1))
    catalog = ModelCatalog()
    catalog.use_compute(torch.device("cuda"), torch.bfloat16)
    await catalog.release_freed_heap()
    assert releases == []
    catalog.use_compute(torch.device("cpu"), torch.float32)
    await catalog.release_freed_heap()
    assert releases == [1]
