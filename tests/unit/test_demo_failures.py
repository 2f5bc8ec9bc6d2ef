"""`hearth demo` ends with one line, not a traceback: exit code 1 when the mesh it needs cannot start, 2 when it
refuses the model it was given before starting anything."""

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
    assert exit_code == 2, err
    assert "hearth demo: unknown random shape 'no-such-shape'" in err and "Traceback" not in err


def test_a_gguf_no_shard_serves_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """A one-layer mamba GGUF asked of two shards: the architecture is what is wrong, said in one line, and the mesh
    is not started (no nats-server binary needed, no work folder made)."""
    import gguf
    import numpy as np

    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ssm_in.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    exit_code = DemoRun(model=str(tmp_path / "mamba.gguf"), shards=2, work_dir=tmp_path / "work").run()
    err = capsys.readouterr().err
    assert exit_code == 2, err
    assert err.strip().splitlines() == [
        "hearth demo: GGUF mamba.gguf holds a 'mamba' model; hearth serves llama, qwen2, qwen3, phi3, gemma2, gemma3 "
        "GGUFs (Mistral is written as llama)"]
    assert not (tmp_path / "work").exists()
