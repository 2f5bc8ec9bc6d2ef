"""A cache version is held in use and older ones removed where the cache allows it; a cache that refuses locks (read
only, or a filesystem without flock) still serves what it holds, and a removal cut short is finished later."""

from __future__ import annotations

import errno
import fcntl

import pytest

from hearth.inference import cache_versions
from hearth.inference.cache_versions import hold_version, is_held, release_held_versions, remove_unused_versions


@pytest.fixture(autouse=True)
def _released():
    yield
    release_held_versions()


@pytest.mark.parametrize("refusal", [errno.EROFS, errno.ENOLCK])
def test_a_cache_refusing_locks_still_serves_a_version_it_holds(tmp_path, monkeypatch, refusal):
    version = tmp_path / "model" / "v1"
    version.mkdir(parents=True)
    (version / "weights").write_text("cached")

    def refused(*_args, **_kwargs):
        raise OSError(refusal, "refused")

    # Read only: no lock file can be opened; no flock: one can be opened but not locked.
    monkeypatch.setattr(cache_versions, "open", refused, raising=False) if refusal == errno.EROFS \
        else monkeypatch.setattr(fcntl, "flock", refused)
    assert hold_version(tmp_path / "model", version) == version
    assert not is_held(version) and (version / "weights").read_text() == "cached"
    assert remove_unused_versions(tmp_path / "model", set()) == []  # nor can anything be removed there


def test_a_version_whose_removal_was_cut_short_is_removed_by_the_next_cleaning(tmp_path):
    model = tmp_path / "model"
    current = hold_version(model, model / "v2")
    left = model / ".v1.4242.removed"  # a process ended between moving v1 aside and deleting it
    (left / "objects").mkdir(parents=True)
    (left / "objects" / "layer").write_bytes(b"\0" * 1024)
    remove_unused_versions(model, {current})
    assert not left.exists() and current.is_dir()
