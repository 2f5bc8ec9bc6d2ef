"""Where the processes of a `hearth bench` run spend their time: py-spy samples every shard and the orchestrator while
the bench warms up and measures, and a summary names, per process and thread, what the samples fell in.

    .venv/bin/python scripts/profile_bench.py --out /tmp/profile -- --model random:llama-250m --quantize int8 \\
        --repeats 1 --new-tokens 400 --sessions 1 --no-library-defaults

Everything after ``--`` goes to `hearth bench` (``--json`` and ``--work-dir`` are added). py-spy (a sampling
profiler: `pip install py-spy`; not a hearth dependency) is found on PATH or given by ``--py-spy``. It attaches once
the bench says its processes are ready, so loading is left out, and samples without stopping them
(``--nonblocking``); a thread counts only while it runs or waits for a core (py-spy leaves out sleeping ones).
Stacks stay in DIR/<process>.txt in py-spy's raw format (for flame-graph tools), the bench's report in
DIR/bench.json, and the summary in DIR/summary.txt: for each process's event loop, compute thread and other threads,
the sampled seconds, the functions the samples fell in (self) and hearth's functions the samples passed through.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

READY_LINE = "all processes ready"
PROCESS_ROLES = ("shard", "orchestrator")
# The thread names hearth gives (hearth/inference/compute_thread.py: COMPUTE_THREAD_NAME, PREFILL_THREAD_NAME).
THREAD_CLASSES = (("hearth-compute", "compute thread"), ("hearth-prefill", "prefill thread"),
                  ("MainThread", "event loop"))
ready_timeout_s = 600.0
py_spy_exit_timeout_s = 60.0
top_functions = 15
_THREAD_FRAME = re.compile(r"^thread \(\d+\): (?P<name>.*)$")
_LINE_NUMBER = re.compile(r":\d+\)$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Folder for the stacks, the report and the summary.")
    parser.add_argument("--rate", type=int, default=200, help="Samples a second per process (default 200).")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="The py-spy executable (default: on PATH).")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="Sample only the processes whose name (role-node id) holds TEXT (repeatable); fewer "
                             "samplers disturb the run less on a small machine.")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `hearth bench`'s arguments.")
    options = parser.parse_args()
    if options.py_spy is None:
        parser.error("py-spy is not on PATH: `pip install py-spy`, or give --py-spy")
    bench_args = options.bench_args[1:] if options.bench_args[:1] == ["--"] else options.bench_args
    options.out.mkdir(parents=True, exist_ok=True)
    stacks = profile_bench(bench_args, options.out, py_spy=options.py_spy, rate=options.rate, only=options.only)
    summary = "\n".join(summarize(name, path, options.rate) for name, path in stacks.items())
    (options.out / "summary.txt").write_text(summary)
    print(summary)


def profile_bench(bench_args: list[str], out: Path, *, py_spy: str, rate: int, only: list[str] = ()
                  ) -> dict[str, Path]:
    """Run the bench with py-spy attached to its processes (those whose name holds one of `only`, when given) once
    they are ready; each process's stacks file."""
    command = [sys.executable, "-m", "hearth.services.cli", "bench", *bench_args, "--json",
               "--work-dir", str(out / "work")]
    with (out / "bench.json").open("w") as report, (out / "bench.log").open("w") as log:
        bench = subprocess.Popen(command, stdout=report, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        relay = threading.Thread(target=_relay_progress, args=(bench.stderr, log, ready), daemon=True)
        relay.start()
        if not ready.wait(ready_timeout_s):
            bench.kill()
            raise SystemExit(f"the bench did not say '{READY_LINE}' within {ready_timeout_s:.0f} s (see {log.name})")
        spies = {name: _attach(py_spy, pid, out / f"{name}.txt", rate)
                 for name, pid in _bench_processes(bench.pid).items() if not only or any(o in name for o in only)}
        if not spies:
            print("no shard or orchestrator process found under the bench", file=sys.stderr)
        bench.wait()
        relay.join(timeout=10)
    for spy in spies.values():
        if spy.poll() is None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        try:
            spy.wait(timeout=py_spy_exit_timeout_s)
        except subprocess.TimeoutExpired:
            spy.kill()
    if bench.returncode != 0:
        print(f"the bench exited with {bench.returncode} (see {out / 'bench.log'})", file=sys.stderr)
    for name in spies:
        if not (out / f"{name}.txt").is_file():
            print(f"py-spy recorded nothing of {name} (see {out / f'{name}.py-spy.log'})", file=sys.stderr)
    return {name: out / f"{name}.txt" for name in spies if (out / f"{name}.txt").is_file()}


def _relay_progress(stream, log, ready: threading.Event) -> None:
    for line in stream:
        log.write(line)
        sys.stderr.write(line)
        if READY_LINE in line:
            ready.set()


def _attach(py_spy: str, pid: int, stacks: Path, rate: int) -> subprocess.Popen:
    # py-spy's own messages (say, ptrace not permitted in a container) go beside the stacks.
    with stacks.with_suffix(".py-spy.log").open("w") as messages:
        return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                 "--threads", "--nonblocking", "--output", str(stacks)],
                                stdout=messages, stderr=subprocess.STDOUT)


def _bench_processes(bench_pid: int) -> dict[str, int]:
    """The bench's shard and orchestrator processes (descendants of its pid), named by role and node id."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children[int(fields[1])].append(int(entry.name))
    found: dict[str, int] = {}
    pending = list(children[bench_pid])
    while pending:
        pid = pending.pop()
        pending.extend(children[pid])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        role = next((word for word in argv if word in PROCESS_ROLES), None)
        if role is not None and any("hearth.services.cli" in word for word in argv):
            node = argv[argv.index("--node-id") + 1] if "--node-id" in argv[:-1] else str(pid)
            found[f"{role}-{node}"] = pid
    return found


def summarize(name: str, stacks: Path, rate: int) -> str:
    """One process's table: per thread class, the sampled seconds, the top functions (self) and hearth's
    functions the samples passed through."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    through: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        match = _THREAD_FRAME.match(frames[0]) if frames else None
        if match is None or not count.isdigit() or len(frames) < 2:
            continue
        thread = thread_class(match.group("name"))
        calls = [_LINE_NUMBER.sub(")", frame) for frame in frames[1:]]
        totals[thread] += int(count)
        own[thread][calls[-1]] += int(count)
        for call in set(calls):
            if "hearth/" in call:
                through[thread][call] += int(count)
    lines = [f"== {name} ({stacks.name})"]
    for thread, total in totals.most_common():
        lines.append(f"  {thread}: {total} samples, {total / rate:.2f} s")
        lines.append("    self:")
        lines += [f"      {count / total:6.1%}  {call}" for call, count in own[thread].most_common(top_functions)]
        lines.append("    through (hearth's):")
        lines += [f"      {count / total:6.1%}  {call}" for call, count in through[thread].most_common(top_functions)]
    return "\n".join(lines) + "\n"


def thread_class(thread_name: str) -> str:
    """What a thread is, by the name hearth or Python gave it."""
    return next((kind for prefix, kind in THREAD_CLASSES if thread_name.startswith(prefix)), "other threads")


if __name__ == "__main__":
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        raise SystemExit("profile_bench.py reads /proc: Linux only")
    main()
