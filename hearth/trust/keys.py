"""A member's Ed25519 key pair as a NATS nkey: create it, keep its seed in a mode-0600 file, sign, and verify a
signature from a public key alone, and seal a secret to a member so only its seed opens it; and the files only their
owner may read (write_private_file, read_private_file), seeds among them, and the folders that hold them
(make_private_folder).

The seed file is the same one nats-server's nkey authentication reads (`nkeys_seed` in nats-py), so one file
both logs a process into the broker and signs what it says. nkeys' own KeyPair cannot verify from a public key
without the seed, so verification decodes the public key and uses PyNaCl (which nkeys itself builds on); each key
decoded is kept for the next check (up to verify_keys_kept of them), since a community's few keys sign almost all.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import functools
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nacl.exceptions
import nacl.public
import nacl.signing
import nkeys

# A file only its owner may read, and a folder of them only its owner may enter.
PRIVATE_FILE_MODE = 0o600
PRIVATE_FOLDER_MODE = 0o700
USER_PUBLIC_KEY_LENGTH = 56  # base32 of prefix byte + 32 key bytes + 2 CRC bytes
PUBLIC_KEY_PATTERN = r"^U[A-Z2-7]{55}$"
# The public keys kept decoded for signature checks, the most recently used: far more than a community's members and
# their retired keys, so theirs stay decoded; a stream of strangers' keys only pushes older ones out (a few hundred
# bytes each), and a malformed key is never kept.
verify_keys_kept = 1024


class KeyFileError(ValueError):
    """A seed file is missing, unreadable, readable by others, or not a NATS user seed."""


@dataclass(frozen=True)
class MemberKey:
    """A member's signing key: the nkey seed (secret) and the public key derived from it (`U...`)."""

    seed: bytes
    public_key: str
    # The key pair decoded from the seed once: decoding it again costs as much as a signature.
    _pair: nkeys.KeyPair = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pair", nkeys.from_seed(bytearray(self.seed)))

    @classmethod
    def generate(cls) -> "MemberKey":
        return cls.from_seed(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER))

    @classmethod
    def from_seed(cls, seed: bytes) -> "MemberKey":
        try:
            pair = nkeys.from_seed(bytearray(seed.strip()))
            public_key = pair.public_key.decode()
        except (nkeys.NkeysError, binascii.Error, ValueError) as error:
            raise KeyFileError(f"not a NATS nkey seed ({type(error).__name__})") from None
        if not public_key.startswith("U"):
            raise KeyFileError("the seed is not a NATS user seed (its public key does not start with U)")
        return cls(seed=bytes(seed.strip()), public_key=public_key)

    @classmethod
    def load(cls, path: Path) -> "MemberKey":
        """Read a seed file; refuse one that others may read (as ssh does), so a leaked seed is not silent."""
        data = read_private_file(path, "the key file")
        try:
            return cls.from_seed(data)
        except KeyFileError as error:
            raise KeyFileError(f"{path}: {error}") from None

    def save(self, path: Path) -> None:
        """Write the seed to a new private file (write_private_file), never replacing an existing key, in a private
        folder (make_private_folder)."""
        make_private_folder(path.parent)
        try:
            write_private_file(path, self.seed + b"\n", replace=False)
        except FileExistsError:
            raise KeyFileError(f"{path} exists; not replacing a key") from None

    def sign(self, data: bytes) -> bytes:
        return self._pair.sign(data)

    def sign_b64(self, data: bytes) -> str:
        return base64.b64encode(self.sign(data)).decode()

    def unseal(self, ciphertext: bytes) -> bytes | None:
        """What `sealed_to(this member's public key, ...)` sealed; None when it was sealed to another key or altered.
        The Ed25519 seed's X25519 counterpart opens it (libsodium's crypto_sign_ed25519_sk_to_curve25519)."""
        _prefix, raw_seed = nkeys.decode_seed(bytearray(self.seed))
        box = nacl.public.SealedBox(nacl.signing.SigningKey(bytes(raw_seed)).to_curve25519_private_key())
        try:
            return box.decrypt(ciphertext)
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
            return None

    def __repr__(self) -> str:  # never the seed
        return f"MemberKey(public_key={self.public_key!r})"


def write_private_file(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write `data` to `path` atomically and privately: through a temporary file in the same folder, created mode
    0600 whatever the umask (mkstemp) and synced, then renamed over `path`, so that no one else can read it at any
    moment and a reader sees the old file or the whole new one, never part of it; a failed write leaves nothing
    behind. `replace=False`: FileExistsError when `path` exists (linked in, which never replaces; where the
    filesystem has no hard links, created exclusively instead: _create_exclusively). A link found at `path` is
    refused (OSError ELOOP), not written through nor silently replaced: someone planted it."""
    if path.is_symlink():
        raise OSError(errno.ELOOP, "a link is where a private file goes", str(path))
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        _write_to_disk(descriptor, data)
        if replace:
            os.replace(temporary, path)
        else:
            try:
                os.link(temporary, path)
            except OSError as error:
                if error.errno not in _NO_HARD_LINKS:
                    raise
                _create_exclusively(path, data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


# What os.link raises on a filesystem that has no hard links (FAT, some network and FUSE mounts); not EEXIST.
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS})


def _create_exclusively(path: Path, data: bytes) -> None:
    """Write `data` to a new file at `path`, created mode 0600 (which no umask widens): O_EXCL, so an existing file
    (or a link) is never replaced (FileExistsError). Not atomic as a link is: a reader may see part of it while it is
    written, so a failed write removes the file it created rather than leave a partial one behind."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        _write_to_disk(descriptor, data)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def _write_to_disk(descriptor: int, data: bytes) -> None:
    """Write `data` to the open file `descriptor` and have it on disk before the file is closed."""
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def make_private_folder(path: Path) -> None:
    """Make `path` a folder only its owner may enter, mode 0700 whatever the umask: created so (missing parents as
    `mkdir -p` makes them), or, when it exists and others may enter it, tightened to 0700, since it is about to hold
    secrets. OSError when it cannot be (a file there, a folder of another user's)."""
    path.mkdir(mode=PRIVATE_FOLDER_MODE, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, mode & PRIVATE_FOLDER_MODE)


def read_bounded_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of `path`, None when there is no such file; ValueError when it holds more than `max_bytes` (read no
    further), OSError when it cannot be read."""
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    if len(data) > max_bytes:
        raise ValueError(f"more than {max_bytes} bytes")
    return data


def read_private_file(path: Path, what: str) -> bytes:
    """The bytes of a file only its owner may read (a seed, the API keys' hashes); KeyFileError naming `what`
    when it cannot be read or others may read it."""
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as error:
        raise KeyFileError(f"cannot read {what} {path}: {error.strerror}") from None
    if mode & 0o077:
        raise KeyFileError(f"{what} {path} is readable by others (mode {mode:o}); run chmod 600 on it")
    return data


@functools.lru_cache(maxsize=verify_keys_kept)
def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """`public_key` decoded for PyNaCl; ValueError (or binascii.Error) for a malformed one, raised again at every ask
    since an exception is never cached."""
    if len(public_key) != USER_PUBLIC_KEY_LENGTH or not public_key.startswith("U"):
        raise ValueError("not a NATS user public key")
    raw = base64.b32decode(public_key)
    body, checksum = raw[:-2], raw[-2:]
    if nkeys.crc16(bytearray(body)).to_bytes(2, "little") != checksum or body[0] != nkeys.PREFIX_BYTE_USER:
        raise ValueError("not a NATS user public key (bad checksum or prefix)")
    return nacl.signing.VerifyKey(bytes(body[1:]))


def check_public_key(public_key: str) -> str:
    """`public_key` if it is a well-formed NATS user public key; ValueError otherwise."""
    try:
        _verify_key(public_key)
    except (ValueError, binascii.Error) as error:
        raise ValueError(f"not a NATS user public key: {error}") from None
    return public_key


def verify(public_key: str, data: bytes, signature: bytes) -> bool:
    """True when `signature` is `public_key`'s Ed25519 signature of `data`; False for any bad input."""
    try:
        _verify_key(public_key).verify(data, signature)
    except (ValueError, binascii.Error, nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError,
            nacl.exceptions.TypeError):
        return False
    return True


def verify_b64(public_key: str, data: bytes, signature_b64: str) -> bool:
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    return verify(public_key, data, signature)


def sealed_to(public_key: str, plaintext: bytes) -> bytes:
    """`plaintext` encrypted to a member's public key with libsodium's anonymous sealed box (X25519 of the Ed25519 key,
    crypto_sign_ed25519_pk_to_curve25519): only that member's seed opens it (MemberKey.unseal); ValueError for a
    malformed key. The box does not say who sealed it: authenticate the sender otherwise (a signature)."""
    try:
        recipient = _verify_key(public_key).to_curve25519_public_key()
    except (binascii.Error, nacl.exceptions.CryptoError, nacl.exceptions.ValueError) as error:
        raise ValueError(f"not a NATS user public key: {error}") from None
    return nacl.public.SealedBox(recipient).encrypt(plaintext)
