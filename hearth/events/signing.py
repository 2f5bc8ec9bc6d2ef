"""Signed events: the canonical bytes of an event, signing them with a member key, and the check a projection
runs before applying an event (signer in the roster, its role may emit the type, the node is its own, the
event is not dated in the future).

The signature covers the event's JSON object as it travels, `signature` left out, keys sorted, no spaces.
A reader checks it over the stored body (not over its own model of the event), so an event from a newer
emitter, with fields this code does not know yet, still verifies, and an unknown field slipped into a
signed event does not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

from hearth.events.member_additions import AdditionLookup, member_by_addition
from hearth.events.member_keys import MemberSuccession, member_by_log
from hearth.events.models import EventEnvelope, MemberChange
from hearth.events.steward_keys import Succession, steward_by_log
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS, stream_for_subject
from hearth.protocol.subjects import event_subject, shard_control_subject
from hearth.trust.keys import MemberKey, verify_b64
from hearth.trust.roster import Member, RemovedMember, RetiredKey, Role, Roster, RosterError

log = logging.getLogger(__name__)

SIGNATURE_FIELD = "signature"

# The verifier's reasons; `unapplicable`, an event no handler could apply (hearth/readmodels/unapplicable.py);
# `duplicate` and `too_old`, a copy of an event applied already or one older than its id is kept
# (hearth/readmodels/applied_events.py); and `newer_hearth`, one only a newer hearth reads
# (hearth/events/newer_hearth.py), kept for a newer projector to find.
RejectionReason = Literal[
    "unsigned", "unknown_signer", "removed_signer", "bad_signature", "role_may_not_emit", "node_mismatch",
    "wrong_stream", "future_dated", "unapplicable", "duplicate", "too_old", "newer_hearth",
]
REJECTION_REASONS: tuple[RejectionReason, ...] = (
    "unsigned", "unknown_signer", "removed_signer", "bad_signature", "role_may_not_emit", "node_mismatch",
    "wrong_stream", "future_dated", "unapplicable", "duplicate", "too_old", "newer_hearth",
)

# Who may say what: a shard host its own shard events; an orchestrator the pipeline and integrity events of the
# calls it runs; a steward (the `system` member) lifts a quarantine and removes members. No other role emits events
# (projectors, auditors and clients only read or ask). A type named in EMITTING_ROLE_BY_TYPE overrides its family's
# rule.
EMITTING_ROLE: dict[str, Role] = {"shard": "shard", "pipeline": "orchestrator", "integrity": "orchestrator"}
EMITTING_ROLE_BY_TYPE: dict[str, Role] = {"integrity.quarantine_cleared": "system", "member.removed": "system",
                                          "member.key_rotated": "system", "member.added": "system"}

# How far an event's date may lead the broker's storage time ([events] max_clock_skew_s's default); a read model
# without a verifier (an open mesh, a rebuild given no roster) judges heartbeats' dates by it too.
DEFAULT_MAX_CLOCK_SKEW_S = 30.0

# How often a long-running verifier looks at its roster file for a change (a member added or removed).
roster_recheck_interval_s = 1.0


def canonical_json(document: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the event's JSON object without `signature`, keys sorted, no spaces."""
    unsigned = {name: value for name, value in document.items() if name != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def canonical_bytes(event: EventEnvelope) -> bytes:
    """The canonical bytes of `event` as it goes on the wire: its JSON read back, so numbers and instants are
    spelled exactly as a reader of the stored message will see them."""
    return canonical_json(json.loads(event.model_dump_json()))


def stored_canonical_bytes(data: bytes) -> bytes | None:
    """The canonical bytes of a stored event body; None when the body is not a JSON object."""
    try:
        document = json.loads(data)
        # Written one call deeper than it was parsed: a body nested just within what the parser took is not.
        return canonical_json(document) if isinstance(document, dict) else None
    except (ValueError, RecursionError):  # a body nested past what this stack parses or writes is no event's
        return None


def sign_event(event: EventEnvelope, key: MemberKey) -> EventEnvelope:
    """A copy of `event` naming `key` as its signer and carrying the signature over its canonical bytes."""
    unsigned = event.model_copy(update={"signer": key.public_key, "signature": None})
    return unsigned.model_copy(update={"signature": key.sign_b64(canonical_bytes(unsigned))})


class RosterFile:
    """A roster kept in a file and read again when the file changes, so a long-running projector knows the
    members a steward added (or removed) after it started. A file that no longer reads keeps the last roster."""

    def __init__(self, path: Path, *, recheck_interval_s: float = roster_recheck_interval_s) -> None:
        self.path = Path(path)
        self.recheck_interval_s = recheck_interval_s
        self._stamp = self._file_stamp()
        self._roster = Roster.load(self.path)
        self._checked_at = time.monotonic()
        self.looked_at = time.time()  # wall clock of the last look at the file

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return status.st_ino, status.st_mtime_ns, status.st_size

    def current(self, *, recheck_now: bool = False) -> Roster:
        """The roster; the file is looked at again when `recheck_now` or the recheck interval has passed."""
        now = time.monotonic()
        if not recheck_now and now - self._checked_at < self.recheck_interval_s:
            return self._roster
        self._checked_at, self.looked_at = now, time.time()
        stamp = self._file_stamp()
        if stamp is not None and stamp != self._stamp:
            try:
                self._roster = Roster.load(self.path)
                self._stamp = stamp
                log.info("roster %s reloaded: %d members", self.path, len(self._roster.members))
            except RosterError as error:
                log.warning("roster %s changed but does not read (%s); keeping the previous one", self.path, error)
        return self._roster


class StreamPosition(NamedTuple):
    """Where the broker stored an event: its stream, its sequence there and the subject it was published on (None:
    not known, then only the stream is checked)."""

    stream: str
    seq: int
    subject: str | None = None


class EventVerifier:
    """Decides whether a projection may apply an event: returns None, or the reason it is rejected."""

    def __init__(self, roster: Roster | RosterFile, *, max_clock_skew_s: float) -> None:
        self._roster_file = roster if isinstance(roster, RosterFile) else None
        self._fixed_roster = roster if isinstance(roster, Roster) else None
        self.max_clock_skew = timedelta(seconds=max_clock_skew_s)
        self._members_of: Roster | None = None
        self._members_by_key: dict[str, Member] = {}
        self._removed_by_key: dict[str, RemovedMember] = {}  # every key no longer accepted (Roster.former_keys)
        self._begun_by_key: dict[str, RetiredKey] = {}  # a rotated-to key: the retirement of the key it replaced

    @classmethod
    def from_roster_file(cls, path: Path, *, max_clock_skew_s: float) -> "EventVerifier":
        return cls(RosterFile(path), max_clock_skew_s=max_clock_skew_s)

    def _member(self, public_key: str) -> Member | RemovedMember | None:
        member = self._lookup(public_key, recheck_now=False)
        if member is None and self._roster_file is not None:
            member = self._lookup(public_key, recheck_now=True)  # perhaps a member added since the last look
        return member

    def current_roster(self) -> Roster:
        """The roster this verifier checks by, as it stands now."""
        return self._current_roster()

    def _current_roster(self, *, recheck_now: bool = False) -> Roster:
        return self._fixed_roster or self._roster_file.current(recheck_now=recheck_now)  # type: ignore[union-attr]

    def _lookup(self, public_key: str, *, recheck_now: bool) -> Member | RemovedMember | None:
        roster = self._current_roster(recheck_now=recheck_now)
        if roster is not self._members_of:
            self._members_by_key = {member.public_key: member for member in roster.members}
            self._removed_by_key = roster.former_keys()  # removed members' keys and retired ones
            self._begun_by_key = roster.key_beginnings()
            self._members_of = roster
        return self._members_by_key.get(public_key) or self._removed_by_key.get(public_key)

    def rejection(self, event: EventEnvelope, *, received_at: datetime, stored_data: bytes = b"",
                  position: StreamPosition | None = None, removal_logged: bool = False,
                  steward_succession: Succession | None = None,
                  member_succession: MemberSuccession | None = None,
                  member_addition: AdditionLookup | None = None) -> RejectionReason | None:
        """Why `event` must not be applied, or None. `received_at` is when the broker stored it (the clock that
        bounds `occurred_at`); `stored_data` is the stored body the signature is checked over (without it, the
        event's own canonical bytes); `position` is where it is stored, which a removed member's cut on that stream
        is set against (without it, or without a cut there, the removal's time is). `removal_logged`: a verified
        `member.removed` of its signer came earlier in the same stream, so it is rejected whatever the roster says
        yet (the steward saves the roster after publishing the removal). `steward_succession`: the steward keys the
        same stream's verified rotations named so far (hearth/events/steward_keys.py), so a signer the roster does
        not know yet is the steward when the log passed the roster's steward key on to it. `member_succession`: the
        member keys the same stream's verified rotations named so far (hearth/events/member_keys.py), so a signer the
        roster does not know yet is the member whose roster key the log passed on to it. `member_addition`: the
        members the same stream's verified additions added so far (hearth/events/member_additions.py), so a signer
        the roster does not know yet is the member the log added under its key."""
        received_at = _aware(received_at)
        reason, member = self._signer_check(event, received_at=received_at, stored_data=stored_data,
                                            position=position, removal_logged=removal_logged,
                                            steward_succession=steward_succession,
                                            member_succession=member_succession, member_addition=member_addition)
        if reason is not None or member is None:
            return reason
        if emitting_role(event.type) != member.role:
            return "role_may_not_emit"
        if not names_only_its_own_node(event, member.name):
            return "node_mismatch"
        if position is not None and not stored_on_its_own_subject(event, position):
            return "wrong_stream"
        if event.occurred_at > received_at + self.max_clock_skew:
            return "future_dated"
        return None

    def signature_rejection(self, event: EventEnvelope, *, received_at: datetime, stored_data: bytes = b"",
                            position: StreamPosition | None = None, removal_logged: bool = False,
                            steward_succession: Succession | None = None,
                            member_succession: MemberSuccession | None = None,
                            member_addition: AdditionLookup | None = None) -> RejectionReason | None:
        """Why `event`'s signature does not stand (unsigned; a signer the roster, nor the log's successions and
        additions, knows, or one removed before it was stored; a bad signature), None when a member signed it: all
        that can be checked of an event only a newer hearth reads, whose type's role and subject rules are the newer
        hearth's. The arguments are rejection()'s."""
        return self._signer_check(event, received_at=_aware(received_at), stored_data=stored_data, position=position,
                                  removal_logged=removal_logged, steward_succession=steward_succession,
                                  member_succession=member_succession, member_addition=member_addition)[0]

    def _signer_check(self, event: EventEnvelope, *, received_at: datetime, stored_data: bytes,
                      position: StreamPosition | None, removal_logged: bool, steward_succession: Succession | None,
                      member_succession: MemberSuccession | None, member_addition: AdditionLookup | None,
                      ) -> tuple[RejectionReason | None, Member | None]:
        """(the reason signature_rejection gives, None) or (None, the member who signed `event`)."""
        if not event.signer or not event.signature:
            return "unsigned", None
        if removal_logged:
            return "removed_signer", None
        if self._roster_file is not None and received_at.timestamp() >= self._roster_file.looked_at:
            # Stored since the file was last looked at: a removal saved meanwhile must count, as it will in a rebuild.
            self._roster_file.current(recheck_now=True)
        member = self._member(event.signer)
        if member is None and steward_succession is not None:
            member = steward_by_log(self._current_roster(), event.signer, steward_succession)
        if member is None and member_succession is not None:
            member = member_by_log(self._current_roster(), event.signer, member_succession, member_addition)
        if member is None and member_addition is not None:
            member = member_by_addition(self._current_roster(), event.signer, member_addition(event.signer))
        if member is None:
            return "unknown_signer", None
        if self._stored_before_it_began(event, received_at, position):
            # A key counts from its rotation's place in each stream, as a projection with an older roster copy
            # follows the rotation in the log: a rebuild with this roster rejects what that projection did.
            return "unknown_signer", None
        if isinstance(member, RemovedMember):
            # What it signed before its removal stays valid, so a rebuild applies what the live projection did.
            stream, seq = (position.stream, position.seq) if position is not None else (None, None)
            if member.stored_after_removal(received_at, stream, seq, event.event_id):
                return "removed_signer", None
            member = member.member
        signed = stored_canonical_bytes(stored_data) if stored_data else canonical_bytes(event)
        if signed is None or not verify_b64(event.signer, signed, event.signature):
            return "bad_signature", None
        return None, member

    def _stored_before_it_began(self, event: EventEnvelope, received_at: datetime,
                                position: StreamPosition | None) -> bool:
        """Whether the roster rotated some key to `event`'s signer and `event` was stored before that rotation: on
        its stream before the rotation's place there, or without one there, before its time."""
        began = self._begun_by_key.get(event.signer or "")
        if began is None:
            return False
        stream, seq = (position.stream, position.seq) if position is not None else (None, None)
        cut = next((cut for cut in began.cuts if cut.stream == stream), None)
        if cut is not None and seq is not None:
            return not cut.passed_by(seq, received_at, event.event_id)
        return received_at < began.retired_at


def _aware(moment: datetime) -> datetime:
    """`moment`, read as UTC when it names no zone."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def stored_on_its_own_subject(event: EventEnvelope, position: StreamPosition) -> bool:
    """Whether `event` is stored where its emitter publishes it: the signature covers the event, not where it went,
    and a member that may publish on one event subject must not have another's signed event counted again there (an
    orchestrator a shard host's in the pipelines stream, one host another's under its own node). A removal marks a
    position only in the stream it names, on that stream's removal subject (so do a rotation and an addition)."""
    if isinstance(event, MemberChange):
        expected = MEMBER_REMOVAL_SUBJECTS.get(event.stream)
        if event.stream != position.stream:
            return False
    else:
        try:
            expected = event_subject(event)  # type: ignore[arg-type]
        except (ValueError, AttributeError):  # a type no emitter publishes
            return False
        if stream_for_subject(expected) != position.stream:
            return False
    return position.subject is None or position.subject == expected


def emitting_role(event_type: str) -> Role | None:
    """The one role whose members may emit `event_type` (None: nobody)."""
    return EMITTING_ROLE_BY_TYPE.get(event_type) or EMITTING_ROLE.get(event_type.split(".", 1)[0])


def names_only_its_own_node(event: EventEnvelope, member_name: str) -> bool:
    """The event speaks for the signer's node only: its node_id is the member's name and, for a shard event,
    the shard (and the control subject it advertises) are that node's, so no host can withdraw or redirect
    another host's shard."""
    if event.node_id != member_name:
        return False
    if not event.type.startswith("shard."):  # type: ignore[attr-defined]
        return True
    shard_id: str = event.shard_id  # type: ignore[attr-defined]
    if not shard_id.endswith(f"@{member_name}"):
        return False
    control_subject = getattr(event, "control_subject", None)
    return control_subject is None or control_subject == shard_control_subject(member_name, shard_id)
