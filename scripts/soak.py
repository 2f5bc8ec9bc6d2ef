"""Runs the soak under faults (hearth/services/devtools/soak.py): greedy chat load with known answers on a mesh of real
processes while shard hosts are killed, frozen and restarted, an orchestrator restarted, household links cut and a
NATS node restarted, one fault at a time; then checks the answers, the event log, `hearth-replay verify`, the
JetStream limits and memory trends. Writes OUT/report.json and OUT/timeline.png; exits 0 when every check passed.

Needs root for the household test bed (network namespaces); without it everything runs on loopback and link cuts
are left out (it says so). Everything it starts is stopped, and the bed removed, even on failure or Ctrl-C.

Usage: sudo .venv/bin/python scripts/soak.py [--minutes 20] [--seed 1] [--out soak-out]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.services.devtools.soak import Soak  # noqa: E402


def _interrupt(*_: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so the mesh and the bed are torn down.
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the load and the faults run")
    parser.add_argument("--seed", type=int, default=1, help="seeds the fault schedule")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="folder for report.json and timeline.png")
    options = parser.parse_args()
    if not options.minutes > 0:
        print(f"soak: --minutes must be above 0, not {options.minutes}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = Soak(options.minutes, options.seed, options.out, log=lambda line: print(line, flush=True)).run()
    except KeyboardInterrupt:
        print("soak: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    print(f"soak: {report['calls']} calls {report['outcomes']}, {len(report['faults'])} faults "
          f"{report['faults_by_kind']}, max failover pause {report['max_failover_pause_s']:.2f} s")
    for check in report["checks"]:
        print(f"  {'ok  ' if check['passed'] else 'FAIL'} {check['name']}: {check['detail'][:300]}")
    print(f"soak: {'passed' if report['passed'] else 'FAILED'}; report {options.out / 'report.json'}, "
          f"timeline {options.out / 'timeline.png'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
