"""The throwaway CA's private keys are created mode 0600 in a folder of mode 0700, and never written through a link
someone planted where a key goes (hearth/services/broker/tls.py)."""

from __future__ import annotations


import pytest

from hearth.services.broker.tls import write_throwaway_ca


def test_keys_are_private_from_their_creation_and_a_planted_link_is_refused(tmp_path):
    files = write_throwaway_ca(tmp_path / "tls")
    for key in (files.server_key_file, files.client_key_file):
        assert key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    planted = tmp_path / "planted"
    planted.mkdir()
    target = tmp_path / "elsewhere.pem"
    target.write_text("not a key")
    (planted / files.server_key_file.name).symlink_to(target)
    with pytest.raises(OSError):
        write_throwaway_ca(planted)
    assert target.read_text() == "not a key"
