"""`hearth-replay verify`: checks every stored event of the event streams by the rule a projection applies
(hearth/events/signing.py: signed, by a member of the roster whose role may emit the type, for its own node, not
stored after its signer's removal, not dated after the broker stored it; and not a copy of an event that passed before
nor older than a read model keeps its id, hearth/readmodels/applied_events.py) and reports each event that fails it,
and each a newer hearth wrote (`newer_hearth`, as a projection keeps it: a member's signature checked, not its
type's rules). The removals and the steward keys each stream's log shows count from where they stand in it, as in
a projection."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hearth.events.consume import SkippedMessage, read_stream
from hearth.events.models import MemberChange
from hearth.events.signing import EventVerifier
from hearth.events.logged_keys import LoggedKeys
from hearth.readmodels.applied_events import DUPLICATE, TOO_OLD, keeps_id, older_than_kept
from hearth.readmodels.rejections import NEWER_HEARTH
from hearth.readmodels.retention import RetentionPolicy, history_kept_s
from hearth.protocol.display_text import display_text

# Not a signature verdict, but just as bad for an audit: a stored message that is no event at all.
UNDECODABLE = "undecodable"
signer_shown_chars = 12
# Ids that aged past what a read model keeps are forgotten every this many events (their copies are too_old anyway).
forget_every_events = 10_000


@dataclass(frozen=True)
class BadEvent:
    """One stored message that a projection would not apply, and why."""

    stream: str
    seq: int
    reason: str
    event_type: str = ""
    event_id: str = ""
    node_id: str = ""
    signer: str | None = None
    detail: str = ""

    def line(self) -> str:
        """One line, whatever the event's member-written fields hold (no escape takes effect, no line is forged)."""
        where = f"{self.stream}#{self.seq}"
        if self.reason == UNDECODABLE:
            return display_text(f"{where} {UNDECODABLE}: {self.detail}")
        signer = f"{self.signer[:signer_shown_chars]}..." if self.signer else "none"
        return display_text(f"{where} {self.event_type} {self.event_id} node={self.node_id} signer={signer}: "
                            f"{self.reason}")


@dataclass
class VerifyReport:
    """What a whole-log check found: messages read per stream and every bad one."""

    checked: dict[str, int] = field(default_factory=dict)
    bad: list[BadEvent] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad

    def summary(self) -> str:
        total = sum(self.checked.values())
        streams = ", ".join(f"{stream} {count}" for stream, count in self.checked.items()) or "no streams"
        if self.ok:
            return f"verified {total} events ({streams}): every one signed by a member that may emit it"
        reasons = ", ".join(f"{reason} {count}" for reason, count in
                            sorted(Counter(bad.reason for bad in self.bad).items()))
        return f"checked {total} events ({streams}): {len(self.bad)} bad ({reasons})"


async def verify_streams(js: Any, verifier: EventVerifier, streams: Iterable[str], *,
                         on_bad: Callable[[BadEvent], None] = lambda bad: None,
                         retention: RetentionPolicy | None = None) -> VerifyReport:
    """Read each stream from its first stored message to its end and check every message; `on_bad` hears of
    each bad one as it is found. `retention`: the read models' (how long they keep applied ids; None: for ever)."""
    report = VerifyReport()
    logged = LoggedKeys()
    for stream in streams:
        report.checked[stream] = 0
        passed = PassedEvents(history_kept_s(retention, stream))
        async with contextlib.aclosing(read_stream(js, stream, from_seq=1, follow=False)) as messages:
            async for message in messages:
                report.checked[stream] += 1
                bad = _verdict(verifier, message, logged, passed)
                if bad is not None:
                    report.bad.append(bad)
                    on_bad(bad)
    return report


class PassedEvents:
    """The ids of one stream's events that passed so far, as a read model keeps them: what tells a copy."""

    def __init__(self, kept_s: float | None) -> None:
        self.kept_s = kept_s
        self._occurred_s: dict[str, float] = {}
        self._until_forget = forget_every_events

    def repeat(self, message: Any) -> str | None:
        """`too_old` or `duplicate` as a projection would reject `message`, else None (and it is remembered)."""
        if older_than_kept(message, self.kept_s):
            return TOO_OLD
        event_id = message.event.event_id
        if not keeps_id(message):  # a heartbeat's copy changes nothing: a read model applies it again too
            return None
        if event_id in self._occurred_s:
            return DUPLICATE
        self._occurred_s[event_id] = message.event.occurred_at.timestamp()
        self._until_forget -= 1
        if self._until_forget <= 0 and self.kept_s is not None:
            self._until_forget = forget_every_events
            oldest_kept = message.time.timestamp() - self.kept_s
            self._occurred_s = {key: at for key, at in self._occurred_s.items() if at >= oldest_kept}
        return None


def _verdict(verifier: EventVerifier, message: Any, logged: LoggedKeys, passed: PassedEvents) -> BadEvent | None:
    if isinstance(message, SkippedMessage):
        envelope = message.newer.envelope if message.newer is not None else None
        if envelope is not None:  # a newer hearth's event: as a projection keeps it, its signature checked
            reason = logged.signature_rejection(verifier, message) or NEWER_HEARTH
            return BadEvent(message.stream, message.seq, reason, event_type=message.newer.label,
                            event_id=envelope.event_id, node_id=envelope.node_id, signer=envelope.signer)
        return BadEvent(message.stream, message.seq, UNDECODABLE, detail=message.error)
    event = message.event
    # The broker's storage time and position, and the removals and steward keys this stream showed before, as in the
    # live projection.
    reason = logged.rejection(verifier, message) or passed.repeat(message)
    if reason is None:
        if isinstance(event, MemberChange):
            logged.record(event)
        return None
    return BadEvent(message.stream, message.seq, reason, event_type=event.type, event_id=event.event_id,
                    node_id=event.node_id, signer=event.signer)
