"""API keys of the HTTP gateway: `hearth community api-key` makes one for a member, the community folder keeps only
its SHA-256 (api_keys.json, mode 0600), and the gateway maps a presented key to that member and its signing key.

A key is shown once, when it is made; what is stored cannot be turned back into it. The gateway signs each call
with the member's own key (keys/<name>.nk in the same folder), so the orchestrator's verifier records the member
who asked, exactly as for `hearth chat --creds`. Presented keys are compared by hash in constant time, against
every stored hash, so neither which entry matched nor how much of it did shows in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.trust.keys import KeyFileError, MemberKey, make_private_folder, read_private_file, write_private_file
from hearth.trust.roster import CALLER_ROLES, MEMBER_NAME_PATTERN, ROSTER_FILE, Roster, RosterError, seed_path

log = logging.getLogger(__name__)

API_KEYS_FILE = "api_keys.json"
API_KEY_PREFIX = "hearth-"
api_key_random_bytes = 32
BEARER = "bearer "


class ApiKeyError(ValueError):
    """The keys file, the roster or a member's key cannot be used; one line for the user."""


class ApiKeyEntry(BaseModel):
    """One API key: the member it belongs to and the SHA-256 of the key (hex); never the key."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=MEMBER_NAME_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: datetime


class ApiKeysFile(BaseModel):
    """api_keys.json in a community folder."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = 1
    keys: list[ApiKeyEntry] = Field(default_factory=list)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _read_keys_file(path: Path) -> ApiKeysFile:
    if not path.exists():
        return ApiKeysFile()
    try:
        data = read_private_file(path, "the API keys file")
    except KeyFileError as error:
        raise ApiKeyError(str(error)) from None
    try:
        return ApiKeysFile.model_validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        raise ApiKeyError(f"{path} is not a hearth API keys file: {'.'.join(map(str, first['loc']))}: "
                          f"{first['msg']}") from None


def _write_keys_file(path: Path, keys: ApiKeysFile) -> None:
    """Replace the file atomically, created mode 0600 (write_private_file: a reader never sees half of it)."""
    make_private_folder(path.parent)  # the community folder
    write_private_file(path, (keys.model_dump_json(indent=2) + "\n").encode())


def _member_key(community_dir: Path, roster: Roster, name: str) -> MemberKey:
    member = roster.by_name(name)
    if member is None:
        raise ApiKeyError(f"{name!r} is not a member of the community in {community_dir}")
    if member.role not in CALLER_ROLES:
        # Its seed also signs what its role says (events, opens): it has no place in an HTTP-facing process, and
        # orchestrators refuse the calls it would sign.
        raise ApiKeyError(f"{name} is a {member.role}; API keys are for members that call "
                          f"({' and '.join(CALLER_ROLES)}): add one with `hearth community add --role client`")
    try:
        key = MemberKey.load(seed_path(community_dir, name))
    except KeyFileError as error:
        raise ApiKeyError(f"the gateway signs {name}'s calls with {name}'s key: {error}") from None
    if key.public_key != member.public_key:
        raise ApiKeyError(f"{seed_path(community_dir, name)} is not the key the roster has for {name}")
    return key


def _roster(community_dir: Path) -> Roster:
    try:
        return Roster.load(community_dir / ROSTER_FILE)
    except RosterError as error:
        raise ApiKeyError(str(error)) from None


def create_api_key(community_dir: Path, name: str) -> str:
    """A new API key for member `name` (whose key must be in the folder); only its hash is stored."""
    _member_key(community_dir, _roster(community_dir), name)
    path = community_dir / API_KEYS_FILE
    keys = _read_keys_file(path)
    api_key = API_KEY_PREFIX + secrets.token_urlsafe(api_key_random_bytes)
    entry = ApiKeyEntry(name=name, sha256=key_digest(api_key), created_at=datetime.now(timezone.utc))
    _write_keys_file(path, keys.model_copy(update={"keys": [*keys.keys, entry]}))
    return api_key


def revoke_api_keys(community_dir: Path, name: str) -> int:
    """Remove every API key of member `name`; how many there were."""
    path = community_dir / API_KEYS_FILE
    keys = _read_keys_file(path)
    kept = [entry for entry in keys.keys if entry.name != name]
    _write_keys_file(path, keys.model_copy(update={"keys": kept}))
    return len(keys.keys) - len(kept)


@dataclass(frozen=True)
class Caller:
    """The member an API key belongs to, and the key its calls are signed with."""

    name: str
    key: MemberKey


class ApiKeyring:
    """Presented API key -> Caller, for the keys in a community folder's api_keys.json."""

    def __init__(self, entries: list[tuple[bytes, Caller]]) -> None:
        self._entries = entries

    @classmethod
    def load(cls, community_dir: Path, *, skip_unusable: bool = False) -> "ApiKeyring":
        """Every key in api_keys.json with its member's signing key; ApiKeyError when one cannot be used, or, with
        `skip_unusable` (a keyring read again while the gateway serves), that member's keys left out with a warning:
        a member removed from the roster must not keep the file's other changes (revocations) from taking effect."""
        path = community_dir / API_KEYS_FILE
        if not path.exists():
            if skip_unusable:  # deleted while the gateway serves: every key is revoked, not the last ones kept
                log.warning("%s no longer exists: no API key is accepted until it does", path)
                return cls([])
            raise ApiKeyError(f"{path} does not exist: make a key with `hearth community api-key --dir "
                              f"{community_dir} --name MEMBER`")
        roster = _roster(community_dir)
        members: dict[str, Caller | None] = {}
        entries = []
        for entry in _read_keys_file(path).keys:
            if entry.name not in members:
                try:
                    members[entry.name] = Caller(entry.name, _member_key(community_dir, roster, entry.name))
                except ApiKeyError as error:
                    if not skip_unusable:
                        raise
                    log.warning("API keys of %s left out: %s", entry.name, error)
                    members[entry.name] = None
            caller = members[entry.name]
            if caller is not None:
                entries.append((bytes.fromhex(entry.sha256), caller))
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def members(self) -> list[str]:
        return sorted({caller.name for _, caller in self._entries})

    def caller_for(self, api_key: str) -> Caller | None:
        digest = hashlib.sha256(api_key.encode()).digest()
        found = None
        for stored, caller in self._entries:  # all of them, whichever matches
            if hmac.compare_digest(stored, digest):
                found = caller
        return found


class WatchedApiKeyring:
    """A community folder's keyring, read again when api_keys.json or the roster changes, so a key made or revoked
    (or a member removed) takes effect within `recheck_s`, with no restart of the gateway.

    Checked on the calls themselves, at most once per `recheck_s`: one stat of each file, and a read only after a
    change (a few kilobytes, so it stays on the event loop). A file that cannot be used after a change keeps the
    last good keyring, with a warning, until the files change again.
    """

    def __init__(self, community_dir: Path, *, recheck_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.community_dir = community_dir
        self.recheck_s = recheck_s
        self._clock = clock
        self._stamp = self._files_stamp()
        self._keyring = ApiKeyring.load(community_dir)  # at start a bad file is an error, not a warning
        self._checked_at = clock()

    def _files_stamp(self) -> tuple:
        stamps = []
        for path in (self.community_dir / API_KEYS_FILE, self.community_dir / ROSTER_FILE):
            try:
                status = path.stat()
            except FileNotFoundError:
                stamps.append(None)
                continue
            stamps.append((status.st_mtime_ns, status.st_size, status.st_ino))
        return tuple(stamps)

    def current(self) -> ApiKeyring:
        """The keyring as the files say now (read again only when they changed since the last check)."""
        now = self._clock()
        if now - self._checked_at < self.recheck_s:
            return self._keyring
        self._checked_at = now
        stamp = self._files_stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._keyring = ApiKeyring.load(self.community_dir, skip_unusable=True)
                log.info("API keys read again: %d keys of %d members", len(self._keyring),
                         len(self._keyring.members))
            except ApiKeyError as error:
                log.warning("API keys not read again, the last good ones stay in use: %s", error)
        return self._keyring

    def __len__(self) -> int:
        return len(self.current())

    @property
    def members(self) -> list[str]:
        return self.current().members

    def caller_for(self, api_key: str) -> Caller | None:
        return self.current().caller_for(api_key)


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (the scheme in any case), else None."""
    if not authorization or not authorization[:len(BEARER)].lower() == BEARER:
        return None
    token = authorization[len(BEARER):].strip()
    return token or None
