"""Signed calls: a client signs each `llm.chat.request` in NATS headers (its public key, a timestamp, a nonce,
an Ed25519 signature over subject, reply inbox, timestamp, nonce and body), and the orchestrator checks the
signer against the roster, the trust it requires, the clock and the nonces it has seen. The steward's own key, and
every member's, follow the rotations the event streams' logs show (hearth/events/steward_keys.py, caller_by_logs;
hearth/events/member_keys.py, member_by_logs), when the checker is told of them
(hearth/services/common/logged_steward_keys.py), and so does a member the logs added (hearth/events/member_additions.py,
member_by_additions) before the roster copy names it, through the rotations the logs show of it too.

The signature covers the reply inbox, so a captured call replayed elsewhere cannot send its answer to a new
place; the nonce cache (kept for twice the allowed clock skew) refuses a replay to the same place, and an
orchestrator's mesh-wide record (hearth/services/common/call_nonces.py) one to another orchestrator of the mesh.

Each header must have exactly the form signers write (a member's public key, a finite decimal timestamp, 32 hex
characters of nonce, a base64 Ed25519 signature) before anything else is done with it: a call with a huge nonce
cannot grow the nonce cache, and one with a `nan` timestamp cannot slip past the clock check.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from hearth.events.clock_skew import ClockSkewReports, skew_in_words
from hearth.events.member_additions import LoggedAddition, member_by_additions
from hearth.events.member_keys import NamedMemberKey, member_by_logs
from hearth.events.steward_keys import caller_by_logs
from hearth.trust.keys import PUBLIC_KEY_PATTERN, MemberKey, verify_b64
from hearth.trust.roster import MEMBER_NAME_PATTERN, Member, Role, Roster, TrustLevel, trust_at_least

HEADER_CALLER = "Hearth-Caller"
HEADER_CALLER_TIME = "Hearth-Caller-Time"
HEADER_CALLER_NONCE = "Hearth-Caller-Nonce"
HEADER_CALLER_SIGNATURE = "Hearth-Caller-Signature"
nonce_bytes = 16
max_remembered_nonces = 100_000
# The exact form of each signing header: unix seconds (at most 12 digits, a few decimals; never `nan`, `inf` or
# an exponent), the nonce signers draw, and standard base64 of a 64-byte Ed25519 signature.
_MEMBER_NAME = re.compile(MEMBER_NAME_PATTERN)
_HEADER_FORMS = {
    HEADER_CALLER: re.compile(PUBLIC_KEY_PATTERN),
    HEADER_CALLER_TIME: re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?$"),
    HEADER_CALLER_NONCE: re.compile(rf"^[0-9a-fA-F]{{{2 * nonce_bytes}}}$"),
    HEADER_CALLER_SIGNATURE: re.compile(r"^[A-Za-z0-9+/]{86}==$"),
}


def malformed_signing_header(headers: Mapping[str, str]) -> str | None:
    """The first signing header present that is not of its exact form (checked before any other work), or None."""
    for name, form in _HEADER_FORMS.items():
        value = headers.get(name)
        # fullmatch on a bounded regex is linear, but a multi-megabyte value need not even be scanned.
        if value is not None and (len(value) > 128 or not form.fullmatch(value)):
            return name
    return None



def _signed_bytes(subject: str, reply: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    return f"hearth-call\n{subject}\n{reply}\n{timestamp}\n{nonce}\n".encode() + body


def signed_call_headers(key: MemberKey, subject: str, reply: str, body: bytes,
                        now_s: float | None = None) -> dict[str, str]:
    """The headers that sign one call of `key`'s member."""
    timestamp = f"{time.time() if now_s is None else now_s:.3f}"
    nonce = secrets.token_hex(nonce_bytes)
    return {HEADER_CALLER: key.public_key, HEADER_CALLER_TIME: timestamp, HEADER_CALLER_NONCE: nonce,
            HEADER_CALLER_SIGNATURE: key.sign_b64(_signed_bytes(subject, reply, timestamp, nonce, body))}


def signed_by(public_key: str, subject: str, reply: str, body: bytes, headers: Mapping[str, str] | None) -> bool:
    """Whether `headers` (as signed_call_headers writes them) sign `subject`, `reply` and `body` with `public_key`;
    no clock, nonce or roster check (for a message only the signer's own processes can hear)."""
    headers = headers or {}
    timestamp, nonce = headers.get(HEADER_CALLER_TIME), headers.get(HEADER_CALLER_NONCE)
    signature = headers.get(HEADER_CALLER_SIGNATURE)
    if headers.get(HEADER_CALLER) != public_key or not (timestamp and nonce and signature):
        return False
    if malformed_signing_header(headers) is not None:
        return False
    return verify_b64(public_key, _signed_bytes(subject, reply, timestamp, nonce, body), signature)


def _none_logged(signer: str) -> tuple[()]:
    """What a checker told of no logs reads of `signer`'s rotations and additions: nothing."""
    return ()


@dataclass(frozen=True)
class CallRefused:
    """Why a call is not accepted; `reason` is a short code for metrics, `message` for the caller; `retry_after_s`
    set: it may be retried (newly signed) after that long, nothing was wrong with it."""

    reason: str
    message: str
    retry_after_s: float | None = None


class CallVerifier:
    """Checks signed calls against a roster: a known signer, a valid signature, a fresh timestamp, an unseen
    nonce, trust at least `min_caller_trust`, and a role among `caller_roles` (None: any role; an orchestrator's
    check of calls gives CALLER_ROLES: hearth/services/common/event_trust.py, call_verifier).
    `logged_steward_keys`: the steward keys the event streams' logs named so far, each with the one it succeeded
    (None: the roster alone says whose key is the steward's); `logged_member_keys`: given a signer's key, the other
    members' keys the logs' rotations named so far that bear on it, each with the one it succeeded and its member
    (every rotation naming it and every rotation of the members those name, as LoggedKeyViews.member_keys_bearing_on
    gives them; None: the roster alone says); `logged_member_additions`: given a signer's key, the members the logs'
    additions added so far that bear on it or on a member whose rotation named it, each with its key
    (LoggedKeyViews.additions_bearing_on_signer; None: the roster alone says);
    `logged_retired_keys`: the keys the logs' removals and rotations retired so far, refused whatever the roster says
    (None: the roster alone says)."""

    def __init__(self, roster: Roster | Callable[[bool], Roster], *, max_clock_skew_s: float,
                 min_caller_trust: TrustLevel, signed: str = "call", receiver: str = "orchestrator",
                 caller_roles: tuple[Role, ...] | None = None,
                 logged_steward_keys: Callable[[], Iterable[tuple[str, str]]] | None = None,
                 logged_retired_keys: Callable[[], Collection[str]] | None = None,
                 logged_member_keys: Callable[[str], Iterable[NamedMemberKey]] | None = None,
                 logged_member_additions: Callable[[str], Iterable[tuple[str, LoggedAddition]]] | None = None) -> None:
        # A callable (given `recheck`: look at the roster file again now) is asked on every call: a long-running
        # orchestrator must know the members a steward added since it started.
        self._roster = roster if callable(roster) else (lambda recheck: roster)
        self.max_clock_skew_s = max_clock_skew_s
        self.min_caller_trust = min_caller_trust
        self.caller_roles = caller_roles
        # What is signed and who checks it, as refusals name them ("the open's timestamp ... this shard's clock").
        self.signed, self.receiver = signed, receiver
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._logged_steward_keys = logged_steward_keys or tuple
        self._logged_retired_keys = logged_retired_keys or frozenset
        self._logged_member_keys = logged_member_keys or _none_logged
        self._logged_member_additions = logged_member_additions or _none_logged
        self._skew_reports = ClockSkewReports()

    @property
    def nonce_window_s(self) -> float:
        """How long a nonce is remembered: a call's timestamp may be max_clock_skew_s ahead of this clock when it
        first comes, and is refused as stale once it is max_clock_skew_s behind."""
        return 2 * self.max_clock_skew_s

    def check(self, subject: str, reply: str, body: bytes, headers: Mapping[str, str] | None,
              now_s: float | None = None) -> Member | CallRefused:
        now_s = time.time() if now_s is None else now_s
        headers = headers or {}
        signer, timestamp = headers.get(HEADER_CALLER), headers.get(HEADER_CALLER_TIME)
        nonce, signature = headers.get(HEADER_CALLER_NONCE), headers.get(HEADER_CALLER_SIGNATURE)
        if not (signer and timestamp and nonce and signature):
            return CallRefused("unsigned", f"the {self.signed} is not signed: send it with a member key (--creds)")
        malformed = malformed_signing_header(headers)
        if malformed is not None:
            return CallRefused("malformed", f"the {self.signed}'s {malformed} header is not of the form signers write "
                                            "(protocol.md of hearth's docs, Signed calls)")
        signed_at_s = float(timestamp)
        # The form admits only finite decimals; checked again because a NaN compares False with everything.
        if not math.isfinite(signed_at_s) or not abs(signed_at_s - now_s) <= self.max_clock_skew_s:
            return self._stale(signed_at_s - now_s, self._signed_by(subject, reply, body, headers))
        member = self._signed_by(subject, reply, body, headers)
        if isinstance(member, CallRefused):
            return member
        if not self._remember(nonce, now_s):
            return CallRefused("replayed", f"this {self.signed} was already received (same nonce)")
        if not trust_at_least(member.trust, self.min_caller_trust):
            return CallRefused("untrusted", f"{member.name} is a {member.trust}; this mesh answers "
                                            f"{self.min_caller_trust} or higher")
        if self.caller_roles is not None and member.role not in self.caller_roles:
            # Its own connection may not publish a call: its key signing one is used where it must not be.
            return CallRefused("role_may_not_call", f"{member.name} is a {member.role}; only "
                                                    f"{' and '.join(self.caller_roles)} members call")
        return member

    def _signed_by(self, subject: str, reply: str, body: bytes, headers: Mapping[str, str]) -> Member | CallRefused:
        """The member whose key signed it, or why not (its key no member's, its signature not matching)."""
        signer, timestamp = headers[HEADER_CALLER], headers[HEADER_CALLER_TIME]
        if signer in self._logged_retired_keys():
            # The log reaches every household at once, a roster copy whenever it is handed out.
            return CallRefused("unknown_signer", f"the {self.signed}'s key was removed from this community (its "
                                                 "removal or rotation is in the event log)")
        named = list(self._logged_steward_keys())
        member = caller_by_logs(self._roster(False), signer, named) or caller_by_logs(self._roster(True), signer, named)
        if member is None:  # perhaps a member's key the logs' rotation named, the roster copy not yet
            member = member_by_logs(self._roster(False), signer, self._logged_member_keys(signer),
                                    self._logged_member_additions(signer))
        if member is None:  # perhaps a member the logs added, the roster copy not yet
            member = member_by_additions(self._roster(False), signer, self._logged_member_additions(signer))
        if member is None:
            return CallRefused("unknown_signer", f"the {self.signed}'s key is not a member of this community")
        signed = _signed_bytes(subject, reply, timestamp, headers[HEADER_CALLER_NONCE], body)
        if not verify_b64(signer, signed, headers[HEADER_CALLER_SIGNATURE]):
            return CallRefused("bad_signature", f"the {self.signed}'s signature does not match it")
        return member

    def _stale(self, skew_s: float, signer: Member | CallRefused) -> CallRefused:
        """The refusal of a call dated `skew_s` off this clock, beyond the limit; the receiver's log says so once a
        while for a member that did sign it (not for whoever puts a member's key in a forged header)."""
        clock = f"this {self.receiver}'s clock"
        if isinstance(signer, Member):
            self._skew_reports.skewed("open" if self.signed == "open" else "call", signer.name, skew_s, clock=clock,
                                      allowed_s=self.max_clock_skew_s, consequence=f"its {self.signed}s are refused")
        return CallRefused("stale", f"the {self.signed} is dated {skew_in_words(skew_s, clock)} (at most "
                                    f"{self.max_clock_skew_s:g} s allowed): its sender's clock or this "
                                    f"{self.receiver}'s is off; set both by NTP")

    def role_of(self, name: str) -> str | None:
        """The role of the roster member called `name` (None: no such member): whose inbox an answer may go to."""
        if not _MEMBER_NAME.fullmatch(name):
            return None  # not a member's name at all: the roster file is not looked at again for it
        member = self._roster(False).by_name(name) or self._roster(True).by_name(name)
        return member.role if member is not None else None

    def _remember(self, nonce: str, now_s: float) -> bool:
        horizon_s = now_s - self.nonce_window_s
        while self._seen and (next(iter(self._seen.values())) < horizon_s
                              or len(self._seen) >= max_remembered_nonces):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now_s
        return True
