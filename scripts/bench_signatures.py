"""Measures what one Ed25519 signature costs where hearth signs and checks (BENCHMARKS.md, "What security costs"): a
heartbeat event signed (sign_event), its signature checked over the stored body (verify_b64 of its canonical bytes),
the whole check a projection runs on it before applying it (EventVerifier.rejection with the stored body), and a
member's signed call checked against its headers (call_signing.signed_by). CPU time per operation, in µs: the lowest
and the median of `--rounds` rounds of `--repeats` each (CPU time is the steadier on a busy machine).

    .venv/bin/python scripts/bench_signatures.py [--repeats 2000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.events.models import ShardHeartbeat, encode_event  # noqa: E402
from hearth.events.signing import EventVerifier, StreamPosition, sign_event, stored_canonical_bytes  # noqa: E402
from hearth.events.streams import SHARDS_STREAM  # noqa: E402
from hearth.protocol.subjects import event_subject, shard_id_for  # noqa: E402
from hearth.services.common.call_signing import signed_by, signed_call_headers  # noqa: E402
from hearth.trust.keys import MemberKey, verify_b64  # noqa: E402
from hearth.trust.roster import new_member, new_roster  # noqa: E402

CALL = ("llm.chat.request", "_INBOX.bench", b'{"messages": [{"role": "user", "content": "hello"}]}')


def per_operation_us(operation: Callable[[], object], repeats: int, rounds: int) -> tuple[float, float]:
    """The lowest and the median, over `rounds`, of the CPU time of one `operation` in µs."""
    figures = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(repeats):
            operation()
        figures.append((time.process_time() - started) / repeats * 1e6)
    return min(figures), statistics.median(figures)


def operations() -> dict[str, Callable[[], object]]:
    """Each measured operation, checked once to do what it is measured for."""
    host, caller = MemberKey.generate(), MemberKey.generate()
    roster = new_roster("bench").with_member(new_member("attic", "shard", host.public_key))
    verifier = EventVerifier(roster, max_clock_skew_s=30.0)
    stored_at = datetime(2026, 12, 6, tzinfo=timezone.utc)
    heartbeat = ShardHeartbeat(shard_id=shard_id_for("bench/model-24l", 0, 7, "attic"), queue_depth=1,
                               active_streams=1, p95_latency_ms=42.5, tokens_served_total=123_456, node_id="attic",
                               occurred_at=stored_at - timedelta(seconds=1))
    signed = sign_event(heartbeat, host)
    stored = encode_event(signed)
    canonical = stored_canonical_bytes(stored)
    position = StreamPosition(SHARDS_STREAM, 1, event_subject(signed))
    headers = signed_call_headers(caller, *CALL)

    def projection_check() -> object:
        return verifier.rejection(signed, received_at=stored_at, stored_data=stored, position=position)

    assert canonical is not None and verify_b64(host.public_key, canonical, signed.signature or "")
    assert projection_check() is None and signed_by(caller.public_key, *CALL, headers)
    return {
        "a heartbeat signed (sign_event)": lambda: sign_event(heartbeat, host),
        "its signature checked (verify_b64)": lambda: verify_b64(host.public_key, canonical, signed.signature or ""),
        "a projection's whole check of it (EventVerifier.rejection)": projection_check,
        "a signed call's signature checked (signed_by)": lambda: signed_by(caller.public_key, *CALL, headers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    for what, operation in operations().items():
        lowest, median = per_operation_us(operation, args.repeats, args.rounds)
        print(f"{what}: {lowest:.1f} µs lowest, {median:.1f} µs median (CPU)", flush=True)


if __name__ == "__main__":
    main()
