"""Files that hold a member's seed, the gateway's API key digests or a TLS private key, and the roster, are created
mode 0600 (whatever the umask, never chmod-ed afterwards) and written atomically (hearth/trust/keys.py,
write_private_file): a write that fails half-way leaves the file as it was, or no file at all, and nothing else
behind. Before, a seed was written in place: a disk that filled up left a partial seed, which blocked adding the
member again ("exists; not replacing a key") and did not load."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.services.broker.tls import write_throwaway_ca
from hearth.services.gateway.keys import API_KEYS_FILE, create_api_key, revoke_api_keys
from hearth.trust.community import Community
from hearth.trust.keys import KeyFileError, MemberKey, write_private_file
from hearth.trust.roster import SYSTEM_MEMBER, seed_path

ROOT = Path(__file__).resolve().parents[2]
# Small enough that a seed (59 bytes) or a roster cannot be written whole.
FILE_SIZE_LIMIT_BYTES = 20


def write_with_a_full_disk(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose files cannot grow past FILE_SIZE_LIMIT_BYTES (as on a full disk: the
    write fails part-way, EFBIG)."""
    prelude = ("import resource, signal\n"
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_SIZE_LIMIT_BYTES}, resource.RLIM_INFINITY))\n")
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_seed_write_that_fails_leaves_no_partial_key_and_the_member_can_be_added_again(tmp_path):
    community = Community.init(tmp_path / "community", "files")
    failed = write_with_a_full_disk("from pathlib import Path\nfrom hearth.trust.community import Community\n"
                                    f"Community(Path({str(community.directory)!r})).add('bob', 'client')\n")
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr
    assert not seed_path(community.directory, "bob").exists()
    assert sorted(path.name for path in (community.directory / "keys").iterdir()) == ["system.nk"]
    added = community.add("bob", "client")
    assert MemberKey.load(added.seed_file).public_key == added.member.public_key


def test_a_roster_write_that_fails_leaves_the_roster_as_it_was_and_nothing_beside_it(tmp_path):
    community = Community.init(tmp_path / "community", "files")
    before = community.roster_path.read_bytes()
    failed = write_with_a_full_disk("from pathlib import Path\nfrom hearth.trust.community import Community\n"
                                    f"Community(Path({str(community.directory)!r})).add('carol', 'client', "
                                    "public_key=" + repr(MemberKey.generate().public_key) + ")\n")
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr
    assert community.roster_path.read_bytes() == before
    assert sorted(path.name for path in community.directory.iterdir()) == ["keys", "roster.json"]


@pytest.fixture
def permissive_umask():
    """Files a process creates are world-readable under this umask unless created with a mode of their own."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_every_file_with_a_secret_and_the_roster_is_created_0600(tmp_path, permissive_umask):
    community = Community.init(tmp_path / "community", "files")
    added = community.add("dave", "client")
    create_api_key(community.directory, "dave")
    tls = write_throwaway_ca(community.directory / "tls")
    for path in (community.system_key_path, added.seed_file, community.roster_path,
                 community.directory / API_KEYS_FILE, tls.server_key_file, tls.client_key_file):
        assert mode(path) == 0o600, path
    assert mode(community.directory) == 0o700 and mode(community.directory / "keys") == 0o700
    assert mode(community.directory / "tls") == 0o700
    # The certificates are public, but under this umask they would be anyone's to replace (a CA swapped in).
    for certificate in (tls.ca_file, tls.server_cert_file, tls.client_cert_file):
        assert mode(certificate) & 0o022 == 0, certificate
    # Rewritten (a member added, a key revoked, the CA made again): still 0600, and nothing left beside them.
    community.add("erin", "client")
    revoke_api_keys(community.directory, "dave")
    tls = write_throwaway_ca(community.directory / "tls")
    for path in (community.roster_path, community.directory / API_KEYS_FILE, tls.server_key_file):
        assert mode(path) == 0o600, path
    assert not [path for path in community.directory.rglob(".*")]


def test_a_file_already_there_is_replaced_not_opened_and_never_replaced_when_it_must_not_be(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"old")
    path.chmod(0o644)
    write_private_file(path, b"new")
    assert path.read_bytes() == b"new" and mode(path) == 0o600
    with pytest.raises(FileExistsError):
        write_private_file(path, b"other", replace=False)
    assert path.read_bytes() == b"new"
    with pytest.raises(KeyFileError, match="exists"):
        MemberKey.generate().save(path)
    assert path.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [path]


def test_community_folders_that_others_may_enter_are_made_private(tmp_path):
    """A folder made before (by hand, by another tool, under a loose umask) is tightened when hearth writes its
    secrets there, not left as it was."""
    directory = tmp_path / "community"
    for folder in (directory, directory / "keys", directory / "tls"):
        folder.mkdir()
        folder.chmod(0o755)
    community = Community.init(directory, "files")
    write_throwaway_ca(directory / "tls")
    assert [mode(folder) for folder in (directory, directory / "keys", directory / "tls")] == [0o700] * 3
    directory.chmod(0o755)
    create_api_key(directory, SYSTEM_MEMBER)
    assert mode(directory) == 0o700 and mode(community.directory / API_KEYS_FILE) == 0o600


@pytest.mark.parametrize("error_number", [errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.ENOSYS])
def test_a_seed_is_saved_where_the_filesystem_has_no_hard_links_and_still_never_replaces_a_key(
        tmp_path, monkeypatch, permissive_umask, error_number):
    """Some network and FUSE mounts refuse os.link; a seed is then created exclusively (O_EXCL), mode 0600 whatever
    the umask, so saving still works and an existing key is still never replaced."""
    monkeypatch.setattr(os, "link", link_failing_with(error_number))
    path = tmp_path / "keys" / "member.nk"
    key = MemberKey.generate()
    key.save(path)
    assert MemberKey.load(path) == key and mode(path) == 0o600
    assert sorted(path.parent.iterdir()) == [path]  # no temporary file left
    with pytest.raises(KeyFileError, match="exists"):
        MemberKey.generate().save(path)
    assert MemberKey.load(path) == key and sorted(path.parent.iterdir()) == [path]


def test_a_seed_write_that_fails_without_hard_links_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", link_failing_with(errno.ENOTSUP))
    synced = os.fsync

    def fsync_failing_the_second_time(descriptor):  # the first is the temporary file's, the second the seed's own
        if fsync_failing_the_second_time.calls:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync_failing_the_second_time.calls += 1
        synced(descriptor)

    fsync_failing_the_second_time.calls = 0
    monkeypatch.setattr(os, "fsync", fsync_failing_the_second_time)
    with pytest.raises(OSError, match="Input/output"):
        MemberKey.generate().save(tmp_path / "member.nk")
    assert list(tmp_path.iterdir()) == []


def test_a_link_refused_for_another_reason_is_not_worked_around(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", link_failing_with(errno.EIO))
    path = tmp_path / "member.nk"
    with pytest.raises(OSError) as raised:
        MemberKey.generate().save(path)
    assert raised.value.errno == errno.EIO and list(tmp_path.iterdir()) == []


def link_failing_with(error_number: int):
    """os.link as a filesystem that refuses it with `error_number` has it."""
    def link(source, destination, *args, **kwargs):
        raise OSError(error_number, os.strerror(error_number))
    return link
