"""A process's `--ready-file` is written whole at once: a reader that waits for it to exist (LocalCluster, a compose
healthcheck, a script) reads what it says, never an empty or half-written file, also when a `hearth host` rewrites it
at a move."""

from __future__ import annotations

from hearth.services.common.lifecycle import write_ready_file


def test_a_ready_file_is_replaced_whole_never_truncated_in_place(tmp_path):
    """Before, `open(path, "w")` truncated the file, then wrote: waiting for it to exist, LocalCluster returned and the
    shard id read from it was "" (seen starting a `hearth host` whose node had served before). A reader holding the
    file open now keeps reading the old text whole, and the path names the new text whole."""
    ready = tmp_path / "host.ready"
    write_ready_file(ready, "tiny:0-1@host-a")
    with open(ready) as reader:  # a script reading the file as the host moves
        write_ready_file(ready, "tiny:2-3@host-a")
        assert reader.read() == "tiny:0-1@host-a"
    assert ready.read_text() == "tiny:2-3@host-a"
    assert [path.name for path in tmp_path.iterdir()] == ["host.ready"]  # nothing left beside it


def test_a_ready_file_in_the_current_folder_is_written_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_ready_file("shard.ready", "s")
    assert (tmp_path / "shard.ready").read_text() == "s"
