"""Measurement (issue 31's "Reach" target): N `hearth host` processes with a memory budget place themselves over a
model, then one greedy request is answered through the mesh they formed; prints each host's chosen range, its
advertised need, its resident memory (and that of a shard's imports alone, so the layers' part shows), and whether
every layer is covered and the request completed.

    .venv/bin/python scripts/reach_hosts.py                           # random:tinyllama-1.1b, 3 hosts, 500 MB, int4
    .venv/bin/python scripts/reach_hosts.py --budget-mb 1200 --quantize int8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hearth.services.devtools.bench.pipeline import pipeline_generation  # noqa: E402
from hearth.services.devtools.bench.process_stats import resident_memory, shard_imports_memory  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402

HOST_READY_TIMEOUT_S = 900.0
PROMPT = " ".join(f"t{index}" for index in range(1, 17))


async def advertised(cluster: LocalCluster) -> dict[str, dict]:
    from hearth.events.consume import read_stream
    from hearth.events.models import ShardAdvertised
    from hearth.events.streams import SHARDS_STREAM

    nc = await connect_nats(cluster.nats_url, name="reach-reader", settings=cluster.nats_settings())
    newest: dict[str, dict] = {}
    try:
        async with contextlib.aclosing(read_stream(nc.jetstream(), SHARDS_STREAM)) as messages:
            async for message in messages:
                event = getattr(message, "event", None)
                if isinstance(event, ShardAdvertised):
                    newest[event.node_id] = {"layers": [event.layer_lo, event.layer_hi],
                                             "total_layers": event.total_layers,
                                             "quantization": event.quantization,
                                             "memory_required_mb": event.memory_required_mb,
                                             "kv_cache_budget_mb": event.kv_cache_budget_mb}
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)
    return newest


async def ask(cluster: LocalCluster, model_ref: str, new_tokens: int) -> list[int]:
    nc = await connect_nats(cluster.nats_url, name="reach-client", settings=cluster.nats_settings())
    try:
        return (await pipeline_generation(nc, model_ref, PROMPT, new_tokens)).token_ids
    finally:
        await asyncio.wait_for(nc.close(), timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:tinyllama-1.1b")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--budget-mb", type=float, default=500.0)
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the started processes")
    args = parser.parse_args()
    model = str(random_checkpoint(args.model)) if args.model.startswith(RANDOM_PREFIX) else args.model
    extra_env = dict(item.split("=", 1) for item in args.env)
    report: dict = {"model": args.model, "budget_mb": args.budget_mb, "quantize": args.quantize, "hosts": {}}
    with LocalCluster(work_dir=args.work_dir, torch_threads=1, extra_env=extra_env, log_level="WARNING") as cluster:
        cluster.start_nats()
        hosts = {}
        for index in range(args.hosts):
            node_id = f"reach-host-{index}"
            print(f"starting {node_id} ...", file=sys.stderr, flush=True)
            # One after another: each reads the coverage the earlier ones advertised.
            process = cluster.start_host(model, args.budget_mb, node_id=node_id, wait_ready=False,
                                         extra_args=["--quantize", args.quantize])
            cluster.wait_ready(process, timeout_s=HOST_READY_TIMEOUT_S)
            hosts[node_id] = process
        orchestrator = cluster.start_orchestrator(node_id="reach-orchestrator", wait_ready=False,
                                                  extra_args=["--preload", model, "--quantize", args.quantize])
        cluster.wait_ready(orchestrator, timeout_s=HOST_READY_TIMEOUT_S)
        adverts = asyncio.run(advertised(cluster))
        covered: set[int] = set()
        for node_id, process in hosts.items():
            memory = resident_memory(process.popen.pid)
            report["hosts"][node_id] = {**adverts.get(node_id, {}), "rss_mb": memory.rss_mb,
                                        "peak_rss_mb": memory.peak_rss_mb, "rss_anonymous_mb": memory.anonymous_mb,
                                        "rss_file_mb": memory.file_mb}
            if node_id in adverts:
                lo, hi = adverts[node_id]["layers"]
                covered.update(range(lo, hi + 1))
        total = next(iter(adverts.values()))["total_layers"] if adverts else None
        report["all_layers_covered"] = total is not None and covered == set(range(total))
        tokens = asyncio.run(ask(cluster, model, args.new_tokens))
        report["answered_tokens"] = len(tokens)
    imports = shard_imports_memory()
    report["shard_imports_rss_mb"] = None if imports is None else imports.rss_mb
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
