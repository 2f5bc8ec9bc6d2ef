"""What the soak checks once its load has stopped: no event lost or stored twice and a read-model rebuild equal to
the live one, `hearth-replay verify`, JetStream streams within their configured limits, and no upward trend in any
long-lived process's memory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from hearth.events.streams import ALL_STREAMS
from hearth.services.broker.connection import connect_nats
from hearth.services.common.hearth_files import SOURCES_ROOT
from hearth.services.devtools.soak_mesh import SoakMesh

replay_timeout_s = 300.0
# A process's memory trends upward when the second half of its samples rises faster than this.
rss_slope_bound_mib_per_min = 2.0
# Only processes that ran at least this share of the soak have a trend to judge (restarted ones start over).
rss_min_share_of_soak = 0.5
rss_min_samples = 8
# A shorter load is still warming up (caches filling, a Go heap growing to its steady size): reported, not judged.
rss_min_judged_load_s = 300.0


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per minute (0 for fewer than two distinct instants)."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def memory_trends(samples: list[dict], soak_s: float) -> list[dict]:
    """Per process run (name and pid) long enough to judge: its RSS at start and end, and the slope of the second
    half of its samples (MiB/min) against rss_slope_bound_mib_per_min (judged only for a load of at least
    rss_min_judged_load_s)."""
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for sample in samples:
        runs.setdefault((sample["process"], sample["pid"]), []).append((sample["t_s"], sample["rss_mib"]))
    trends = []
    for (name, pid), points in sorted(runs.items()):
        span_s = points[-1][0] - points[0][0]
        if span_s < rss_min_share_of_soak * soak_s or len(points) < rss_min_samples:
            continue
        slope = slope_per_minute(points[len(points) // 2:])
        trends.append({"process": name, "pid": pid, "span_s": round(span_s, 1), "first_mib": points[0][1],
                       "last_mib": points[-1][1], "max_mib": max(v for _, v in points),
                       "second_half_slope_mib_per_min": round(slope, 3),
                       "upward": soak_s >= rss_min_judged_load_s and slope > rss_slope_bound_mib_per_min})
    return trends


def read_rss_mib(pid: int) -> float | None:
    """A process's resident memory (VmRSS) in MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def replay_verify(mesh: SoakMesh) -> subprocess.CompletedProcess:
    """`hearth-replay verify` as an auditor of the community."""
    cluster = mesh.cluster
    env = {**os.environ, **cluster.credentials_env(cluster.member_key("auditor", "auditor")), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "hearth.services.replay.cli", "verify", "--nats", cluster.nats_url],
                          capture_output=True, text=True, env=env, cwd=SOURCES_ROOT, timeout=replay_timeout_s)


async def stream_limits(js) -> tuple[list[dict], list[str]]:
    """Each event stream's configured limits and what it holds; the problems (a limit unset, or exceeded)."""
    streams, problems = [], []
    for name in ALL_STREAMS:
        info = await js.stream_info(name)
        config, state = info.config, info.state
        retention = getattr(config.retention, "value", config.retention)
        streams.append({"stream": name, "bytes": state.bytes, "messages": state.messages, "max_bytes": config.max_bytes,
                        "max_msgs": config.max_msgs, "max_age_s": config.max_age, "retention": retention,
                        "replicas": config.num_replicas})
        if retention != "limits":
            problems.append(f"{name}: retention {retention}, not limits")
        if not (config.max_bytes or 0) > 0 or not (config.max_age or 0) > 0:
            problems.append(f"{name}: unbounded (max_bytes {config.max_bytes}, max_age {config.max_age})")
        elif state.bytes > config.max_bytes:
            problems.append(f"{name}: holds {state.bytes} bytes over its max_bytes {config.max_bytes}")
        if (config.max_msgs or -1) > 0 and state.messages > config.max_msgs:
            problems.append(f"{name}: holds {state.messages} messages over its max_msgs {config.max_msgs}")
    return streams, problems


async def final_checks(mesh: SoakMesh) -> tuple[list[CheckResult], dict]:
    """Stop what publishes (shard hosts heartbeat, orchestrators flush their audit events), then check the log,
    the replay audit and the streams' limits. Returns the checks and the streams' numbers."""
    from tests.e2e.event_log_checks import assert_no_event_lost  # the e2e tests' own checks, reused
    from tests.e2e.failover_support import read_events

    for process in [*(slot.process for slot in mesh.shards), *mesh.orchestrators.values()]:
        await asyncio.to_thread(process.stop)
    checks: list[CheckResult] = []
    nc = await connect_nats(mesh.cluster.nats_url, name="soak-checks", settings=mesh.cluster.nats_settings())
    try:
        js = nc.jetstream()
        rebuilt = mesh.work_dir / "rebuilt.sqlite"
        try:
            await assert_no_event_lost(nc, mesh.projector_db, rebuilt)
            checks.append(CheckResult("no_event_lost_and_rebuild_equal", True,
                                      "every gap in the sequences is trimming the streams'"
                                      " limits explain; the projector's read model equals a rebuild"))
        except AssertionError as failure:
            checks.append(CheckResult("no_event_lost_and_rebuild_equal", False, str(failure)[:2000]))
        duplicates = {}
        for stream in ALL_STREAMS:
            ids = Counter(item.event.event_id for item in await read_events(nc, stream))
            duplicates[stream] = sorted(event_id for event_id, stored in ids.items() if stored > 1)
        checks.append(CheckResult("no_event_stored_twice", not any(duplicates.values()),
                                  "; ".join(f"{stream}: {len(ids)} duplicated ids {ids[:3]}"
                                            for stream, ids in duplicates.items())))
        streams, problems = await stream_limits(js)
        checks.append(CheckResult("jetstream_within_limits", not problems, "; ".join(problems) or "retention limits,"
                                  " max_bytes and max_age set, every stream below its max_bytes"))
    finally:
        async with asyncio.timeout(5):
            await nc.close()
    audit = await asyncio.to_thread(replay_verify, mesh)
    checks.append(CheckResult("replay_verify_exit_0", audit.returncode == 0,
                              f"exit {audit.returncode}: {(audit.stdout + audit.stderr).strip()[-1500:]}"))
    return checks, {"streams": streams, "replay_verify_exit": audit.returncode}
