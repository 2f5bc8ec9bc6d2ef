"""Builds a multi-household test bed on this machine (hearth/services/devtools/netbed.py) and holds it until Ctrl-C, then removes it.

A hub namespace (for the broker and the orchestrator) and one namespace per household, joined by veth links to a
bridge in the hub, addresses from 198.18.0.0/24 that exist only inside those namespaces. While it is up, run
processes inside with `ip netns exec NAME ...` (printed below), cut a household's link with
`ip -n HUB link set to-hN down` (and `up` to heal it). Links may be shaped to a bandwidth (tc tbf); with
`--relay-to PORT` each household reaches PORT on the hub's address through a latency relay adding `--rtt-ms`
(hearth/services/devtools/netbed_relay.py; start the broker on that port in the hub, households dial the printed URL).
Needs root.

Usage: sudo .venv/bin/python scripts/netbed.py [--households 3] [--rate-mbit 100] [--relay-to 4222 --rtt-ms 10]
       [--hold-s 0] [--sweep]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.services.devtools.netbed import NetBed, max_households, sweep_stale, unavailable_reason  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--households", type=int, default=3, help=f"households to make (1-{max_households})")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="shape every household's link to this many Mbit/s each way (default: unshaped)")
    parser.add_argument("--relay-to", type=int, default=None, metavar="PORT",
                        help="relay each household to PORT on the hub's address (default: no relay)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="the round-trip time each relayed link adds")
    parser.add_argument("--hold-s", type=float, default=0.0,
                        help="remove the bed after this many seconds (default 0: hold until Ctrl-C)")
    parser.add_argument("--sweep", action="store_true",
                        help="only remove beds left behind by runs that were killed, and exit")
    options = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"netbed: cannot make a test bed here: {reason}", file=sys.stderr)
        return 2
    if options.sweep:
        removed = sweep_stale()
        print(f"netbed: removed {len(removed)} stale namespaces {' '.join(removed)}".rstrip())
        return 0
    if not 1 <= options.households <= max_households:
        print(f"netbed: --households must be 1 to {max_households}, not {options.households}", file=sys.stderr)
        return 2
    if options.rate_mbit is not None and not options.rate_mbit > 0:
        print(f"netbed: --rate-mbit must be above 0, not {options.rate_mbit}", file=sys.stderr)
        return 2
    if options.rtt_ms < 0 or (options.rtt_ms and options.relay_to is None):
        print("netbed: --rtt-ms needs --relay-to PORT and is at least 0", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with NetBed(options.households) as bed:
        if options.rate_mbit is not None:
            for index in range(options.households):
                bed.shape(index, options.rate_mbit)
        if options.relay_to is not None:
            bed.start_relay(options.relay_to, options.rtt_ms)
        print(f"hub        {bed.hub.namespace:<24} {bed.hub.address}")
        for index, household in enumerate(bed.households):
            print(f"household {index} {household.namespace:<24} {household.address}  "
                  f"(cut: ip -n {bed.hub.namespace} link set {bed.hub_port(index)} down)"
                  + (f"  broker via {bed.relay_url(index)} (+{options.rtt_ms:g} ms RTT)"
                     if options.relay_to is not None else ""))
        print(f"run a process inside: {' '.join(bed.hub.exec_prefix())} COMMAND", flush=True)
        try:
            done.wait(options.hold_s or None)
        except KeyboardInterrupt:
            pass
    print("netbed: removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
