"""What an idle mesh costs its machine: each process's CPU time, wake-ups, memory and disk writes while nobody calls.

Starts the mesh `hearth demo --serve` runs (nats-server, the prefork launcher, shard hosts of the bundled model, an
orchestrator, a projector and a gateway), lets it settle, then reads each process from /proc over idle windows:
CPU time used (utime + stime of every thread), context switches of every thread (voluntary + involuntary: how often
it woke), RSS, and what it wrote (write_bytes: to the disk; wchar: through write calls), and what the event streams
and the read model grew by. The same after a few calls, to show nothing keeps running once they end. On a machine
shared with other work, CPU time (not percent of wall time) is what idle processes used; `--windows` repeats each.

    .venv/bin/python scripts/bench_idle.py [--settle-s 20] [--window-s 60] [--windows 2] [--calls 5] [--threads]

`--threads` also lists, per process, the threads that woke most, to find what wakes (py-spy dump names them);
`--heartbeat-interval-s` sets the shard hosts' heartbeat interval, to see what the heartbeats cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from hearth.protocol.chat import ChatMessage, ChatRequest  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.client.chat import chat  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.gateway.keys import create_api_key  # noqa: E402
from soak_leaks_measures import start_monitored_nats  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO_ROOT / "models" / "hearth-tiny-llama"
BUNDLED_LAYERS = 6
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CALL_TIMEOUT_S = 120.0


@dataclass
class ThreadCounters:
    name: str
    cpu_ticks: int
    switches: int


@dataclass
class ProcessCounters:
    """One reading of a process from /proc."""

    cpu_ticks: int
    voluntary: int
    involuntary: int
    rss_kib: int
    write_bytes: int
    wchar: int
    threads: dict[int, ThreadCounters] = field(default_factory=dict)


def _stat_fields(path: Path) -> list[str]:
    """A /proc stat line's fields after the command name (which may hold spaces): field 3 of proc(5) comes first."""
    text = path.read_text()
    return text[text.rindex(")") + 2:].split()


def _status(path: Path) -> dict[str, str]:
    return {key: value.strip() for key, _, value in
            (line.partition(":") for line in path.read_text().splitlines())}


def read_process(pid: int) -> ProcessCounters:
    root = Path(f"/proc/{pid}")
    fields = _stat_fields(root / "stat")
    io = {key: int(value) for key, _, value in (line.partition(": ") for line in (root / "io").read_text().splitlines())}
    counters = ProcessCounters(cpu_ticks=int(fields[11]) + int(fields[12]), voluntary=0, involuntary=0,
                               rss_kib=int(_status(root / "status")["VmRSS"].split()[0]),
                               write_bytes=io["write_bytes"], wchar=io["wchar"])
    for task in (root / "task").iterdir():
        try:
            status = _status(task / "status")
            thread_fields = _stat_fields(task / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between the listing and the read
        voluntary, involuntary = int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])
        counters.voluntary += voluntary
        counters.involuntary += involuntary
        counters.threads[int(task.name)] = ThreadCounters(
            status["Name"], int(thread_fields[11]) + int(thread_fields[12]), voluntary + involuntary)
    return counters


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(entry / "stat")[1]) == pid:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    return found


def mesh_processes(cluster: LocalCluster, nats_pid: int) -> dict[str, int]:
    """Every process of the mesh by name: nats-server, the prefork launcher (this process's other child) and hearth's."""
    processes = {"nats-server": nats_pid}
    hearth_pids = {process.popen.pid for process in cluster.processes}
    for pid in children_of(os.getpid()):
        if pid != nats_pid and pid not in hearth_pids:
            processes["prefork launcher"] = pid
    processes.update({process.name: process.popen.pid for process in cluster.processes if process.alive})
    return processes


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def mesh_files(cluster: LocalCluster, nats, db_path: Path) -> dict[str, int]:
    """The streams' messages and bytes, the broker's store and the read model (with its WAL) on disk."""
    numbers: dict[str, int] = {}
    jsz = nats.monitor("jsz?streams=true")
    for account in jsz.get("account_details", []):
        for stream in account.get("stream_detail", []):
            numbers[f"{stream['name']} messages"] = stream["state"]["messages"]
            numbers[f"{stream['name']} bytes"] = stream["state"]["bytes"]
    numbers["broker store bytes"] = folder_bytes(cluster.work_dir / "nats")
    numbers["read model bytes"] = sum(path.stat().st_size for path in db_path.parent.glob(db_path.name + "*"))
    return numbers


def measure_window(processes: dict[str, int], cluster: LocalCluster, nats, db_path: Path, window_s: float) -> dict:
    """Each process's use over `window_s` seconds of idle (per minute), and what the mesh's files grew by."""
    before = {name: read_process(pid) for name, pid in processes.items()}
    files_before = mesh_files(cluster, nats, db_path)
    started = time.monotonic()
    time.sleep(window_s)
    after = {name: read_process(pid) for name, pid in processes.items()}
    elapsed_s = time.monotonic() - started
    files_after = mesh_files(cluster, nats, db_path)
    per_minute = 60.0 / elapsed_s
    rows = {}
    for name, end in after.items():
        start = before[name]
        threads = []
        for tid, thread in end.threads.items():
            earlier = start.threads.get(tid, ThreadCounters(thread.name, 0, 0))
            woke = thread.switches - earlier.switches
            if woke:
                threads.append((thread.name, tid, round(woke / elapsed_s, 2),
                                round((thread.cpu_ticks - earlier.cpu_ticks) * 1000 / CLOCK_TICKS * per_minute)))
        rows[name] = {
            "cpu_ms_per_min": round((end.cpu_ticks - start.cpu_ticks) * 1000 / CLOCK_TICKS * per_minute, 1),
            "wakeups_per_s": round((end.voluntary + end.involuntary - start.voluntary - start.involuntary)
                                   / elapsed_s, 2),
            "rss_mib": [round(start.rss_kib / 1024, 1), round(end.rss_kib / 1024, 1)],
            "disk_kib_per_min": round((end.write_bytes - start.write_bytes) / 1024 * per_minute, 1),
            "written_kib_per_min": round((end.wchar - start.wchar) / 1024 * per_minute, 1),
            "threads": len(end.threads),
            "waking_threads": sorted(threads, key=lambda row: -row[2]),
        }
    return {"window_s": round(elapsed_s, 1), "processes": rows,
            "files_growth": {key: files_after[key] - files_before.get(key, 0) for key in files_after},
            "files": files_after}


async def make_calls(cluster: LocalCluster, gateway_url: str, api_key: str, model: str, calls: int) -> list[str]:
    """`calls` chat calls over NATS (one streamed by two choices) and `calls` over the gateway; their endings."""
    endings = []
    nc = await connect_nats(cluster.nats_url, name="bench-idle", settings=cluster.nats_settings())
    try:
        for index in range(calls):
            result = await chat(nc, ChatRequest(model=model, messages=[ChatMessage(role="user", content=f"Hi {index}")],
                                                max_tokens=16, n=2 if index == 0 else 1))
            endings.append(getattr(result.frames[-1], "type", "none") if result.frames else "none")
    finally:
        await nc.close()
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        listed = (await http.get(f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})).json()
        for index in range(calls):
            response = await http.post(f"{gateway_url}/v1/chat/completions",
                                       headers={"Authorization": f"Bearer {api_key}"},
                                       json={"model": listed["data"][0]["id"], "max_tokens": 16,
                                             "messages": [{"role": "user", "content": f"Hello {index}"}]})
            endings.append(str(response.status_code))
    return endings


def print_window(label: str, window: dict, show_threads: bool) -> None:
    print(f"\n{label} ({window['window_s']} s)")
    print(f"  {'process':34s} {'CPU ms/min':>10s} {'wake-ups/s':>10s} {'RSS MiB':>15s} {'disk KiB/min':>12s} "
          f"{'write() KiB/min':>15s} {'threads':>7s}")
    for name, row in window["processes"].items():
        rss = f"{row['rss_mib'][0]:.1f}->{row['rss_mib'][1]:.1f}"
        print(f"  {name:34s} {row['cpu_ms_per_min']:10.1f} {row['wakeups_per_s']:10.2f} {rss:>15s} "
              f"{row['disk_kib_per_min']:12.1f} {row['written_kib_per_min']:15.1f} {row['threads']:7d}")
        if show_threads:
            for thread_name, tid, per_s, cpu_ms in row["waking_threads"][:6]:
                print(f"      {thread_name:16s} {tid:>8d} {per_s:8.2f} wake-ups/s {cpu_ms:6d} CPU ms/min")
    total_cpu = sum(row["cpu_ms_per_min"] for row in window["processes"].values())
    total_wakeups = sum(row["wakeups_per_s"] for row in window["processes"].values())
    print(f"  {'all':34s} {total_cpu:10.1f} {total_wakeups:10.2f}")
    print("  grew: " + ", ".join(f"{key} {value:+d}" for key, value in window["files_growth"].items()))


def run(options: argparse.Namespace) -> dict:
    report: dict = {"settle_s": options.settle_s, "window_s": options.window_s, "windows": []}
    env = {}
    if options.heartbeat_interval_s is not None:
        env["HEARTH_SHARD__HEARTBEAT_INTERVAL_S"] = repr(options.heartbeat_interval_s)
    with LocalCluster(torch_threads=options.torch_threads, extra_env=env, prefork=True) as cluster:
        nats = start_monitored_nats(cluster)
        db_path = cluster.work_dir / "readmodel.sqlite"
        cluster.start_projector(db_path, wait_ready=False)
        for index, (lo, hi) in enumerate(even_layer_ranges(BUNDLED_LAYERS, options.shards)):
            cluster.start_shard(str(options.model), lo, hi, node_id=f"idle-host-{index}", wait_ready=False)
        cluster.start_orchestrator(extra_args=["--preload", str(options.model)], wait_ready=False)
        cluster.wait_all_ready()
        cluster.member_key("idle-client", "client")
        api_key = create_api_key(cluster.community.directory, "idle-client")
        gateway_url = cluster.start_gateway(name="idle-client").ready_file.read_text().strip()
        processes = mesh_processes(cluster, nats.pid)

        def idle_windows(label: str) -> None:
            time.sleep(options.settle_s)
            for index in range(options.windows):
                window = measure_window(processes, cluster, nats, db_path, options.window_s)
                window["label"] = f"{label}, window {index + 1}"
                report["windows"].append(window)
                print_window(window["label"], window, options.threads)

        idle_windows("idle after start-up")
        if options.calls:
            endings = asyncio.run(make_calls(cluster, gateway_url, api_key, str(options.model), options.calls))
            print(f"\ncalls: {endings}")
            report["call_endings"] = endings
            idle_windows("idle after the calls")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="a checkpoint folder of 6 layers")
    parser.add_argument("--shards", type=int, default=3, help="shard hosts splitting its layers")
    parser.add_argument("--torch-threads", type=int, default=None, help="each process's torch threads")
    parser.add_argument("--settle-s", type=float, default=20.0, help="wait before the first window")
    parser.add_argument("--window-s", type=float, default=60.0, help="length of each idle window")
    parser.add_argument("--windows", type=int, default=2, help="idle windows before and after the calls")
    parser.add_argument("--calls", type=int, default=5, help="calls over NATS and over the gateway (0: none)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=None,
                        help="the shard hosts' [shard] heartbeat_interval_s (default: theirs, 2 s)")
    parser.add_argument("--threads", action="store_true", help="list the threads that woke most")
    parser.add_argument("--out", type=Path, default=None, help="also write the report as JSON")
    options = parser.parse_args()
    if options.heartbeat_interval_s is not None and options.heartbeat_interval_s <= 0:
        parser.error("--heartbeat-interval-s must be above 0")
    if options.settle_s < 0 or options.window_s <= 0 or options.windows < 1 or options.calls < 0:
        parser.error("--settle-s at least 0, --window-s above 0, --windows at least 1, --calls at least 0")
    if not 1 <= options.shards <= BUNDLED_LAYERS:
        parser.error(f"--shards must be between 1 and {BUNDLED_LAYERS}")
    report = run(options)
    if options.out is not None:
        options.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
