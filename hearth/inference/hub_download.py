"""Downloading one file of a hub repository at a commit, never more bytes than the repository's listing states.

huggingface_hub's downloader takes whatever a server sends and checks its size only once the file is written, so a
mirror sending an oversized file could fill the disk first. Here a Content-Length beyond the listed size is refused
before any byte of the body is read, and a body running past it (no Content-Length, or a lying one) is cut off at
that byte; either way its partial file is removed and the error is one line. A download broken off midway resumes
(TRANSFER_RETRIES times, and again on the next start) from the partial file, which a lock file beside it keeps to one
writer among the processes sharing the cache (a process waits for a twin's download only while its partial file
grows). Every request names the commit, whose files never change.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from .errors import CheckpointError
from .hub_ids import HUB_ENDPOINT_ENV

# Retries of a transfer that broke off, each resuming where the last ended (a whole file's here, a byte range's in
# hub_gguf.py).
TRANSFER_RETRIES = 5
PARTIAL_SUFFIX = ".part"
LOCK_SUFFIX = ".lock"
# A twin process downloading the same file is waited for until its partial file stops growing for this long (at
# least as long as its retries may take without a byte: each waits a connect and a read timeout).
TWIN_STALL_MIN_S = 120.0
TWIN_POLL_S = 0.5


class OversizedDownload(CheckpointError):
    """A server sent, or stated it would send, more bytes than the listing states for the file."""


def listed_size(entry) -> int:
    """The size a listing entry (huggingface_hub's RepoFile) states for its file: its LFS object's for an LFS file."""
    return entry.lfs.size if entry.lfs is not None else entry.size


def download_listed_file(repo_id: str, commit: str, entry, folder: Path) -> Path:
    """`folder`/NAME holding listing `entry`'s file of `repo_id` at `commit`: kept when already there at its listed
    size (one of another size is removed first), else downloaded, resumed from a partial download when one is there.
    CheckpointError (one line) when the server states or sends another size than listed; nothing of an oversized
    file is kept."""
    name, size = entry.path, listed_size(entry)
    target = folder / name
    if is_sized(target, size):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{name}{PARTIAL_SUFFIX}"
    with open(folder / f".{name}{LOCK_SUFFIX}", "a") as lock:
        lock_after_twin(lock, partial, repo_id, name)  # released when closed
        if is_sized(target, size):
            return target
        target.unlink(missing_ok=True)  # damaged or of another size: no longer the listed file
        try:
            with partial.open("ab") as out:
                _download_into(repo_id, commit, name, size, out)
        except OversizedDownload:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, target)
    return target


def lock_after_twin(lock, partial: Path, repo_id: str, name: str) -> None:
    """Lock `lock` exclusively once a twin process downloading the file ends; CheckpointError (one line) when the
    twin's partial file has not grown for the stall limit (a stopped or stuck process)."""
    from huggingface_hub import constants

    stall_s = max(TWIN_STALL_MIN_S, (TRANSFER_RETRIES + 1) * 2 * constants.HF_HUB_DOWNLOAD_TIMEOUT)
    seen, since = None, time.monotonic()
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        try:
            grown = partial.stat().st_size
        except OSError:  # not begun, or just renamed into place
            grown = None
        if grown != seen:
            seen, since = grown, time.monotonic()
        elif time.monotonic() - since >= stall_s:
            raise CheckpointError(f"model {repo_id!r}: another process has been downloading {name} without progress "
                                  f"for {stall_s:.0f} s (it holds {lock.name}): stop it, or try again")
        time.sleep(TWIN_POLL_S)


def is_sized(file: Path, size: int) -> bool:
    """Whether `file` is there with `size` bytes (a file renamed into place whole may be cut short since: a crash
    before its bytes reached the disk leaves it empty)."""
    try:
        return file.is_file() and file.stat().st_size == size
    except OSError:
        return False


def _download_into(repo_id: str, commit: str, name: str, size: int, out) -> None:
    """Append `name`'s bytes to `out` (already holding its first bytes when resumed) until it holds `size`."""
    import httpx2
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo_id, name, revision=commit, endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None)
    have, retries = out.seek(0, os.SEEK_END), TRANSFER_RETRIES
    if have > size:  # a partial longer than the file: start again
        out.truncate(0)
        have = 0
    with byte_progress(size, name, initial=have) as bar:
        while have < size:
            # Identity encoding: Content-Length is then the file's own size, and a resumed range its own bytes.
            headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                    hf_raise_for_status(response)
                    if have and not _resumes_at(response, have):  # the whole file came back: start again
                        out.truncate(0)
                        bar.update(-have)
                        have = 0
                    _check_stated_length(repo_id, name, size, have, response)
                    for chunk in response.iter_bytes():
                        if have + len(chunk) > size:
                            raise OversizedDownload(f"model {repo_id!r}: {name} arrived with more than the {size} "
                                                    "bytes its listing states (a tampered mirror?): download stopped "
                                                    "and removed")
                        out.write(chunk)
                        have += len(chunk)
                        bar.update(len(chunk))
            except (httpx2.TransportError, httpx2.StreamError):
                if retries == 0:
                    raise
                retries -= 1
                continue
            break
    if have != size:
        raise CheckpointError(f"model {repo_id!r}: {name} arrived with {have} bytes, not the {size} its listing "
                              "states (the transfer ended early; the next start resumes it)")


def _resumes_at(response, have: int) -> bool:
    """Whether `response` answers a request for the bytes from `have` on with exactly those."""
    content_range = response.headers.get("Content-Range", "")
    return response.status_code == 206 and content_range.startswith(f"bytes {have}-")


def _check_stated_length(repo_id: str, name: str, size: int, have: int, response) -> None:
    stated = response.headers.get("Content-Length")
    if stated is not None and stated.isdigit() and have + int(stated) > size:
        raise OversizedDownload(f"model {repo_id!r}: {name} is {have + int(stated)} bytes, not the {size} its "
                                "listing states (as the server states it: a tampered mirror?); nothing of it was "
                                "downloaded")


@contextlib.contextmanager
def byte_progress(total_bytes: int, description: str, *, initial: int = 0, shown: bool = True):
    """A byte progress bar of a hub download or of hashing a weight file (huggingface_hub's, which its settings can
    turn off; none when not `shown`)."""
    from huggingface_hub.utils import tqdm

    with tqdm(total=total_bytes, initial=initial, unit="B", unit_scale=True, desc=description, leave=False,
              disable=not shown) as bar:
        yield bar
