"""What scripts/soak_leaks.py measures of a running mesh: each process's RSS, descriptors and threads from /proc, its
Python objects, asyncio tasks and container sizes through gdb (--census), the broker's connections, subscriptions,
consumers and streams from nats-server's monitoring endpoint, the read model's rows and size, and what grew."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

from hearth.services.broker.listen_ports import free_tcp_port
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.streams import create_community_streams_blocking
from hearth.services.devtools.local_cluster import LocalCluster

MONITOR_TIMEOUT_S = 5.0


class MonitoredNatsServer(EmbeddedNatsServer):
    """The embedded nats-server with its HTTP monitoring endpoint on `monitor_port` (connz, subsz, jsz)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.monitor_port = free_tcp_port()

    def render_config(self) -> str:
        return super().render_config() + f'http: "127.0.0.1:{self.monitor_port}"\n'

    def monitor(self, endpoint: str) -> dict:
        url = f"http://127.0.0.1:{self.monitor_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=MONITOR_TIMEOUT_S) as response:
            return json.loads(response.read())


def start_monitored_nats(cluster: LocalCluster) -> MonitoredNatsServer:
    """As LocalCluster.start_nats, with monitoring on."""
    server = MonitoredNatsServer(store_dir=cluster.work_dir / "nats", authorization=cluster._authorization())
    cluster.nats = server.start()
    cluster.nats_url = server.url
    settings = cluster.nats_settings()
    create_community_streams_blocking(settings, cluster.system_creds, ready_timeout_s=settings.streams_create_timeout_s)
    return server


def proc_numbers(pid: int) -> dict:
    """RSS (KiB), threads and open descriptors of `pid` from /proc."""
    numbers = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            numbers[key] = int(value.split()[0])
    numbers["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return numbers


# Run inside a process through gdb (its own GIL taken), after a full collection: glibc's heap in use and free, object
# counts by type, the asyncio tasks by coroutine, and the length of every container attribute of hearth's and
# nats-py's objects and module globals (summed by class and attribute), as JSON to a file.
CENSUS_CODE = """
import asyncio, collections, ctypes, gc, json, sys
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                                    'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
def _malloc():
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {'in_use': info.uordblks, 'free': info.fordblks, 'mmapped': info.hblkhd}
def _census(path):
    gc.collect()
    objects = gc.get_objects()
    types = collections.Counter(type(o).__module__ + '.' + type(o).__qualname__ for o in objects)
    loops = [o for o in objects if isinstance(o, asyncio.AbstractEventLoop) and not o.is_closed()]
    tasks = collections.Counter()
    for loop in loops:
        for task in asyncio.all_tasks(loop):
            coro = task.get_coro()
            tasks[getattr(coro, '__qualname__', repr(coro))] += 1
    kinds = (dict, set, list, collections.deque, collections.OrderedDict, collections.defaultdict)
    sizes = collections.Counter()
    for o in objects:
        module = type(o).__module__ or ''
        if not module.startswith(('hearth', 'nats')) or not hasattr(o, '__dict__'):
            continue
        for name, value in vars(o).items():
            if isinstance(value, kinds):
                sizes[type(o).__qualname__ + '.' + name] += len(value)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(('hearth', 'nats')):
            for name, value in list(vars(module).items()):
                if isinstance(value, kinds) and not name.startswith('__'):
                    sizes[module_name + ':' + name] += len(value)
    with open(path, 'w') as f:
        json.dump({'types': dict(types), 'tasks': dict(tasks), 'objects': len(objects), 'malloc': _malloc(),
                   'containers': {k: v for k, v in sizes.items() if v}}, f)
_census(%r)
del _census
"""
CENSUS_TIMEOUT_S = 60


def heap_census(pid: int, out_dir: Path, label: str) -> dict | None:
    """CENSUS_CODE run in `pid` through gdb; None when it could not be (no gdb, no permission)."""
    path = out_dir / f"census-{pid}-{label.replace(' ', '-')}.json"
    code = CENSUS_CODE % str(path)
    # Only libpython's and libc's symbols: loading torch's too would take minutes per process. The code runs when the
    # main thread enters epoll_wait (asyncio) or epoll_pwait (uvloop), where its event loop has let the GIL go: a
    # thread stopped anywhere else may be inside take_gil, and taking the GIL again there deadlocks the process.
    command = ["gdb", "-batch", "-nx", "-iex", "set auto-solib-add off", "-p", str(pid),
               "-ex", "sharedlibrary libpython", "-ex", "sharedlibrary libc.so", "-ex", "break epoll_wait thread 1",
               "-ex", "break epoll_pwait thread 1",
               "-ex", "continue", "-ex", "delete",
               "-ex", "call (int)PyGILState_Ensure()",
               "-ex", f"call (int)PyRun_SimpleString({json.dumps(code)})",
               "-ex", "call (void)PyGILState_Release($1)", "-ex", "detach"]
    try:
        subprocess.run(command, capture_output=True, timeout=CENSUS_TIMEOUT_S, check=False)
        return json.loads(path.read_text())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def read_model_numbers(db_path: Path) -> dict:
    """Each table's rows and the file's bytes (with its WAL)."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)) as db:
        tables = [row[0] for row in db.execute("select name from sqlite_master where type='table'")]
        rows = {table: db.execute(f'select count(*) from "{table}"').fetchone()[0] for table in tables}
    wal = db_path.with_name(db_path.name + "-wal")
    return {"rows": rows, "bytes": db_path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)}


def metrics_gauges(url: str) -> dict[str, float]:
    """A process's /metrics samples that are not histograms' or counters' (the ones that should come back)."""
    with urllib.request.urlopen(url, timeout=MONITOR_TIMEOUT_S) as response:
        text = response.read().decode()
    kinds, values = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind
        elif line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if kinds.get(name.partition("{")[0]) == "gauge":
                values[name] = float(value)
    return values


def snapshot(cluster: LocalCluster, nats: MonitoredNatsServer, db_path: Path) -> dict:
    processes = {process.name: proc_numbers(process.popen.pid) for process in cluster.processes if process.alive}
    processes["nats-server"] = proc_numbers(nats.pid)
    connz = nats.monitor("connz?subs=1")
    subscriptions = {connection.get("name") or str(connection["cid"]): connection.get("num_subscriptions", 0)
                     for connection in connz["connections"]}
    jsz = nats.monitor("jsz?streams=true&consumers=true")
    streams = {}
    for account in jsz.get("account_details", []):
        for stream in account.get("stream_detail", []):
            streams[stream["name"]] = {"messages": stream["state"]["messages"], "bytes": stream["state"]["bytes"],
                                       "consumers": stream["state"].get("consumer_count", 0)}
    gauges = {}
    for name, url in cluster.metrics_urls().items():
        with contextlib.suppress(OSError):
            gauges[name] = {key: value for key, value in metrics_gauges(url).items() if value}
    return {"t": time.time(), "processes": processes, "connections": connz["num_connections"],
            "subscriptions": subscriptions, "total_subscriptions": nats.monitor("subsz")["num_subscriptions"],
            "streams": streams, "read_model": read_model_numbers(db_path), "gauges": gauges}


def growth(report: dict) -> dict:
    """Per process, what changed from the first round's end to the last's: a leak grows in every round, a bounded
    cache or an allocator's first growth stops after the first ones."""
    first, last = report["snapshots"][2], report["snapshots"][-1]
    changes = {name: {key: numbers[key] - first["processes"][name][key] for key in numbers}
               for name, numbers in last["processes"].items() if name in first["processes"]}
    changes["nats"] = {"subscriptions": last["total_subscriptions"] - first["total_subscriptions"],
                       "connections": last["connections"] - first["connections"],
                       "consumers": {name: stream["consumers"] - first["streams"].get(name, {}).get("consumers", 0)
                                     for name, stream in last["streams"].items()}}
    for name, census in (last.get("census") or {}).items():
        before = (first.get("census") or {}).get(name)
        if census and before:
            changes[name]["python_objects"] = census["objects"] - before["objects"]
            changes[name]["asyncio_tasks"] = sum(census["tasks"].values()) - sum(before["tasks"].values())
            if census.get("malloc") and before.get("malloc"):
                changes[name]["malloc_in_use"] = census["malloc"]["in_use"] - before["malloc"]["in_use"]
            changes[name]["containers_grown"] = {
                key: [before["containers"].get(key, 0), size] for key, size in census["containers"].items()
                if size > before["containers"].get(key, 0)}
    return changes
