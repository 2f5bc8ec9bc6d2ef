"""Models and schemes a command cannot use end it with one line naming what and why, no traceback, as real
processes: an orchestrator's --preload that does not exist, is a folder holding several GGUFs or a `store:NAME`
nobody published, and its --local-model that does not load (against a real broker); `hearth bench --model` a GGUF
of an architecture hearth does not serve; and a scheme or device the bench's baseline worker cannot load the model
in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.services.devtools.bench.errors import BenchError
from hearth.services.devtools.bench.monolithic import MonolithicWorker

pytestmark = [pytest.mark.integration, pytest.mark.scheduled_first]

HEARTH = str(Path(sys.executable).parent / "hearth")
REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = REPO_ROOT / "models" / "hearth-tiny-llama"
ENV = {**{k: v for k, v in os.environ.items() if k not in ("HEARTH_NATS_URL", "HEARTH_CONFIG")},
       "OMP_NUM_THREADS": "1", "HEARTH_NATS__INSECURE": "1"}  # an open broker: credentials are not the point here
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
exit_timeout_s = 120.0


def two_ggufs(tmp_path: Path) -> str:
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (folder / name).write_bytes(b"GGUF")
    return str(folder)


# A path of this machine is the caller's input (exit 2, as `hearth host` refuses its --model); the store may fail for
# now (exit 1).
@pytest.mark.parametrize(("model", "why", "exit_code"), [
    (lambda tmp_path: str(tmp_path / "nope.gguf"), "does not exist", 2),
    (two_ggufs, "holds several GGUF files (a.gguf, b.gguf)", 2),
    (lambda tmp_path: "store:nobody-published-this", "nothing was published", 1),
], ids=["missing-path", "two-ggufs", "unpublished-store-name"])
def test_an_unknown_preload_is_one_line_naming_it(model, why, exit_code, nats_url, tmp_path):
    spec = model(tmp_path)
    completed = subprocess.run([HEARTH, "orchestrator", "--node-id", "bad-preload", "--torch-threads", "1",
                                "--preload", spec, "--nats", nats_url], capture_output=True, text=True, env=ENV,
                               cwd=REPO_ROOT, timeout=exit_timeout_s)
    lines = [line for line in completed.stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert completed.returncode == exit_code, completed.stderr
    assert "Traceback" not in completed.stderr
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith(f"hearth orchestrator: --preload: unknown model {spec!r}"), lines[0]
    assert why in lines[0], lines[0]



def test_a_local_model_that_does_not_load_is_named_as_such_not_as_the_preload(nats_url, tmp_path):
    mamba = small_gguf(tmp_path / "mamba.gguf", "mamba")
    completed = subprocess.run([HEARTH, "orchestrator", "--node-id", "bad-local", "--torch-threads", "1",
                                "--preload", str(MODEL), "--local-model", str(mamba), "--nats", nats_url],
                               capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=exit_timeout_s)
    lines = [line for line in completed.stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert completed.returncode == 2, completed.stderr  # a file of this machine: the caller's input
    assert lines == [f"hearth orchestrator: --local-model {mamba}: GGUF mamba.gguf holds a 'mamba' model; hearth "
                     "serves llama, qwen2, qwen3, phi3, gemma2, gemma3 GGUFs (Mistral is written as llama)"], \
        completed.stderr


def small_gguf(path: Path, architecture: str = "llama") -> Path:
    """A GGUF whose metadata describes a one-layer `architecture` model (enough for a layer count to be read)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bench_refuses_a_gguf_of_an_unserved_architecture_in_one_line_before_starting_anything(tmp_path):
    model = small_gguf(tmp_path / "mamba.gguf", "mamba")
    completed = subprocess.run([HEARTH, "bench", "--model", str(model), "--repeats", "1", "--work-dir",
                                str(tmp_path / "work")], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT,
                               timeout=exit_timeout_s)
    assert completed.returncode == 1, completed.stderr
    assert completed.stderr.strip().splitlines() == [
        "hearth bench: GGUF mamba.gguf holds a 'mamba' model; hearth serves llama, qwen2, qwen3, phi3, gemma2, "
        "gemma3 GGUFs (Mistral is written as llama)"]
    assert not (tmp_path / "work").exists()  # no broker, shard or worker was started


@pytest.mark.parametrize(("options", "why"), [
    ({"quantize": "int4/g33"}, "int4 group size 33 is not one of 32, 64, 128, 256"),
    ({"device": "cuda:99"}, "cuda:99"),
], ids=["int4-group-33", "a-device-not-here"])
def test_the_bench_baseline_says_in_one_line_why_it_cannot_load_the_model(options, why, tmp_path):
    worker = MonolithicWorker(MODEL, {"OMP_NUM_THREADS": "1"}, 1, tmp_path / "monolithic.log", **options)
    try:
        with pytest.raises(BenchError) as refused:
            worker.wait_ready()
    finally:
        worker.close()
    message = str(refused.value)
    assert message.startswith(f"the monolithic worker cannot load {MODEL}: "), message
    assert why in message and "\n" not in message, message
    assert "Traceback" not in (tmp_path / "monolithic.log").read_text()
