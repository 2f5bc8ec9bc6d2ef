"""Every test runs with its own state folder (tests/conftest.py's own_state_folder): nothing a test does writes under
the user's ~/.local/state/hearth, and nothing one test kept there (a host's last range, an event outbox) reaches
another; the prefork launchers serving LocalCluster are shared all the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hearth.services.common.hearth_files import state_dir
from hearth.services.devtools.prefork import import_environment


@pytest.mark.parametrize("turn", ["first", "second"])
def test_each_test_starts_with_an_empty_state_folder_of_its_own(turn, own_state_folder, tmp_path):
    """Each of the two turns writes what a host keeps; the other finds its folder empty all the same."""
    folder = Path(os.environ["XDG_STATE_HOME"])
    assert folder == own_state_folder and list(folder.iterdir()) == []
    assert not folder.is_relative_to(Path.home() / ".local" / "state") and not folder.is_relative_to(tmp_path)
    kept = state_dir("host-last-range")
    assert kept.is_relative_to(folder)
    kept.mkdir(parents=True)
    (kept / "node.json").write_text(turn)


def test_a_launcher_is_shared_by_tests_whose_state_folders_differ():
    """XDG_STATE_HOME is read when a command runs, after the fork: two state folders need no second launcher (which
    would import torch again for every test), whereas XDG_CACHE_HOME (read by Hugging Face as it is imported) does."""
    assert import_environment({"XDG_STATE_HOME": "/a"}) == import_environment({"XDG_STATE_HOME": "/b"})
    assert import_environment({"XDG_CACHE_HOME": "/a"}) != import_environment({"XDG_CACHE_HOME": "/b"})
