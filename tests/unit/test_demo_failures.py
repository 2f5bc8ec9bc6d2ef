"""`hearth demo` ends with one line and exit code 1, not a traceback, when the mesh it needs cannot start."""

from __future__ import annotations

import sys

from hearth.services.devtools.demo import DemoRun


def test_without_a_nats_server_binary_the_demo_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    # Neither beside the interpreter nor on PATH (services.broker.server.find_nats_server_binary).
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    exit_code = DemoRun(model="hearth-tiny-llama", shards=1, work_dir=tmp_path / "work").run()
    err = capsys.readouterr().err
    assert exit_code == 1, err
    assert "hearth demo: nats-server binary not found" in err and "Traceback" not in err


def test_an_unknown_random_shape_is_refused_in_one_line(tmp_path, capsys):
    exit_code = DemoRun(model="random:no-such-shape", work_dir=tmp_path / "work").run()
    err = capsys.readouterr().err
    assert exit_code == 1, err
    assert "hearth demo: unknown random shape 'no-such-shape'" in err and "Traceback" not in err
