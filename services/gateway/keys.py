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
import os
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trust.keys import KeyFileError, MemberKey, read_private_file
from trust.roster import MEMBER_NAME_PATTERN, ROSTER_FILE, Roster, RosterError, seed_path

API_KEYS_FILE = "api_keys.json"
API_KEYS_FILE_MODE = 0o600
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
    """Replace the file atomically, created mode 0600 (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".api_keys-")
    with os.fdopen(descriptor, "w") as handle:  # mkstemp creates it mode 0600
        handle.write(keys.model_dump_json(indent=2) + "\n")
    os.replace(temporary, path)
    os.chmod(path, API_KEYS_FILE_MODE)


def _member_key(community_dir: Path, roster: Roster, name: str) -> MemberKey:
    member = roster.by_name(name)
    if member is None:
        raise ApiKeyError(f"{name!r} is not a member of the community in {community_dir}")
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
    def load(cls, community_dir: Path) -> "ApiKeyring":
        """Every key in api_keys.json with its member's signing key; ApiKeyError when one cannot be used."""
        path = community_dir / API_KEYS_FILE
        if not path.exists():
            raise ApiKeyError(f"{path} does not exist: make a key with `hearth community api-key --dir "
                              f"{community_dir} --name MEMBER`")
        roster = _roster(community_dir)
        members: dict[str, Caller] = {}
        entries = []
        for entry in _read_keys_file(path).keys:
            if entry.name not in members:
                members[entry.name] = Caller(entry.name, _member_key(community_dir, roster, entry.name))
            entries.append((bytes.fromhex(entry.sha256), members[entry.name]))
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


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (the scheme in any case), else None."""
    if not authorization or not authorization[:len(BEARER)].lower() == BEARER:
        return None
    token = authorization[len(BEARER):].strip()
    return token or None
