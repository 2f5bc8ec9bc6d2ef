"""Measures what the keys the event logs retired and named cost a process with no read model (BENCHMARKS.md, "What
security costs"): a follower (hearth/services/common/logged_steward_keys.py) started from a kept file of `--entries`
removals, member key rotations and additions (a third each), then, per question, the best of 5 rounds of
`--repeats` asks:

- one `retired_keys()`;
- one signed call checked by the orchestrator's CallVerifier (event_trust.call_verifier): a roster member's call,
  and a stranger's (a key no member holds, refused `unknown_signer`);
- one step's membership check of a hop's host (event_trust.node_membership, asked per hop before each step) and one
  open's sealing key (event_trust.member_public_keys).

With `--start`, what a process's start costs instead: reading the kept file, judging each entry again and recording
it (kept_steward_keys.load_kept_removals), the best of `--rounds` starts, and the share of its CPU time the entries'
Ed25519 signature checks take (each checked alone, key decoding included, the same number of times).

    .venv/bin/python scripts/bench_logged_keys.py --entries 0,100,10000
    .venv/bin/python scripts/bench_logged_keys.py --start --entries 1000,5000,10000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.events.consume import StoredEvent  # noqa: E402
from hearth.events.models import MemberAdded, MemberKeyRotated, MemberRemoved, encode_event  # noqa: E402
from hearth.events.signing import EventVerifier, sign_event, stored_canonical_bytes  # noqa: E402
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, SHARDS_STREAM  # noqa: E402
from hearth.services.common import event_trust  # noqa: E402
from hearth.services.common.call_signing import signed_call_headers  # noqa: E402
from hearth.services.common.config import HearthSettings  # noqa: E402
from hearth.services.common.kept_steward_keys import (  # noqa: E402
    KeptRemoval, load_kept_removals, read_kept_removals, write_kept_removals,
)
from hearth.services.common.logged_steward_keys import StewardKeysFromTheLog  # noqa: E402
from hearth.trust.keys import MemberKey, verify_b64  # noqa: E402
from hearth.trust.roster import SYSTEM_MEMBER, new_member, new_roster  # noqa: E402

CALL = ("llm.chat.request", "_INBOX.bench", b'{"messages": []}')
SKEW_S = 30.0


def kept_entries(steward: MemberKey, count: int, now: datetime) -> list[KeptRemoval]:
    """`count` verified member changes on the shards stream, signed by `steward`: removals, rotations, additions."""
    events = []
    for index in range(count):
        key = MemberKey.generate().public_key
        common = dict(node_id=SYSTEM_MEMBER, public_key=key, stream=SHARDS_STREAM, occurred_at=now)
        if index % 3 == 0:
            event = MemberRemoved(member=f"gone-{index}", **common)
        elif index % 3 == 1:
            event = MemberKeyRotated(member=f"rotated-{index}", new_public_key=MemberKey.generate().public_key,
                                     **common)
        else:
            event = MemberAdded(member=f"added-{index}", role="client", trust="member", **common)
        events.append(sign_event(event, steward))
    return [KeptRemoval.of(StoredEvent(stream=SHARDS_STREAM, seq=seq, subject=MEMBER_REMOVAL_SUBJECTS[SHARDS_STREAM],
                                       time=now, headers={}, event=event, data=encode_event(event)))
            for seq, event in enumerate(events, 1)]


def best_us(ask: Callable[[int], object], repeats: int) -> float:
    """The best of 5 rounds of `repeats` asks, per ask, in microseconds."""
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for index in range(repeats):
            ask(index)
        rounds.append((time.perf_counter() - started) / repeats * 1e6)
    return min(rounds)


async def measure(entries: int, repeats: int, folder: Path) -> dict[str, float]:
    steward, caller, attic, stranger = (MemberKey.generate() for _ in range(4))
    roster = new_roster("bench")
    for name, role, key in ((SYSTEM_MEMBER, "system", steward), ("phone", "client", caller),
                            ("attic", "shard", attic)):
        roster = roster.with_member(new_member(name, role, key.public_key))
    roster_file = folder / "roster.json"
    roster.save(roster_file)
    settings = HearthSettings.model_validate({"nats": {"creds_file": str(folder / "hub.nk"),
                                                       "roster_file": str(roster_file)}})
    now = datetime.now(timezone.utc)
    kept_file = folder / "steward-keys.json"
    write_kept_removals(kept_file, kept_entries(steward, entries, now))
    follower = StewardKeysFromTheLog(None, EventVerifier(roster, max_clock_skew_s=SKEW_S), (), kept_file)
    await follower.start()
    try:
        learned = len(follower.retired_keys()) + len(follower.member_additions())
        assert learned == entries, f"the kept file taught {learned} of {entries} changes"
        calls = event_trust.call_verifier(settings, follower)
        membership = event_trust.node_membership(settings, follower)
        sealing_key = event_trust.member_public_keys(settings, follower)
        now_s = time.time()
        rounds = 5 * repeats
        signed = [signed_call_headers(caller, *CALL, now_s=now_s) for _ in range(rounds + 1)]  # a nonce each
        strangers = [signed_call_headers(stranger, *CALL, now_s=now_s) for _ in range(rounds)]
        turn = itertools.count(1)
        assert calls.check(*CALL, signed[0], now_s=now_s).name == "phone"
        assert calls.check(*CALL, strangers[0], now_s=now_s).reason == "unknown_signer"
        assert membership("attic") is None and sealing_key("attic") == attic.public_key
        return {
            "retired_keys()": best_us(lambda _: follower.retired_keys(), repeats),
            "member's call checked": best_us(lambda _: calls.check(*CALL, signed[next(turn)], now_s=now_s),
                                             repeats),
            "stranger's call refused": best_us(lambda i: calls.check(*CALL, strangers[i], now_s=now_s), repeats),
            "step's membership check of a host": best_us(lambda _: membership("attic"), repeats),
            "open's sealing key": best_us(lambda _: sealing_key("attic"), repeats),
        }
    finally:
        await follower.stop()


def measure_start(entries: int, rounds: int, folder: Path) -> dict[str, float]:
    """A start's load of a kept file of `entries` changes, and its entries' signature checks alone, best of `rounds`,
    in seconds of the wall clock and of this process's CPU time (the steadier on a busy machine)."""
    steward = MemberKey.generate()
    roster = new_roster("bench").with_member(new_member(SYSTEM_MEMBER, "system", steward.public_key))
    kept_file = folder / "steward-keys.json"
    write_kept_removals(kept_file, kept_entries(steward, entries, datetime.now(timezone.utc)))
    verifier = EventVerifier(roster, max_clock_skew_s=SKEW_S)
    signed = [(message.event.signer, stored_canonical_bytes(message.data), message.event.signature)
              for message in (removal.stored_event() for removal in read_kept_removals(kept_file))]
    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        logged, kept = load_kept_removals(kept_file, verifier)
        figures.setdefault("start", []).append(time.perf_counter() - wall)
        figures.setdefault("start CPU", []).append(time.process_time() - cpu)
        assert len(kept) == entries and len(logged.removed) + len(logged.additions) == entries
        wall, cpu = time.perf_counter(), time.process_time()
        assert all(verify_b64(*check) for check in signed)
        figures.setdefault("signature checks", []).append(time.perf_counter() - wall)
        figures.setdefault("signature checks CPU", []).append(time.process_time() - cpu)
    return {what: min(seconds) for what, seconds in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", default="0,100,10000", help="kept entries to measure with, comma-separated")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--start", action="store_true", help="measure a start's load of the kept file instead")
    parser.add_argument("--rounds", type=int, default=3, help="starts measured per size, with --start")
    args = parser.parse_args()
    if args.start:
        for entries in (int(count) for count in args.entries.split(",")):
            with tempfile.TemporaryDirectory() as folder:
                figures = measure_start(entries, args.rounds, Path(folder))
            print(f"{entries:>6} entries: start {figures['start']:.3f} s (CPU {figures['start CPU']:.3f} s), of "
                  f"which signature checks {figures['signature checks']:.3f} s (CPU "
                  f"{figures['signature checks CPU']:.3f} s, "
                  f"{figures['signature checks CPU'] / max(figures['start CPU'], 1e-9):.0%})", flush=True)
        return
    for entries in (int(count) for count in args.entries.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            figures = asyncio.run(measure(entries, args.repeats, Path(folder)))
        print(f"{entries:>6} entries: " + "; ".join(f"{what} {us:.1f} µs" for what, us in figures.items()),
              flush=True)


if __name__ == "__main__":
    main()
