"""`hearth demo` as a user runs it: a subprocess that starts the whole mesh, streams one answer and cleans up."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_MODEL = REPO_ROOT / "models" / "hearth-tiny-llama"
MAX_TOKENS = 12
demo_timeout_s = 150.0
serve_ready_timeout_s = 150.0

pytestmark = pytest.mark.timeout(300)


def demo_command(model_args: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "hearth.services.cli", "demo", *model_args, "--max-tokens", str(MAX_TOKENS),
            "--torch-threads", "1", *extra]


@pytest.fixture
def model_args(tiny_model_path) -> list[str]:
    """The bundled toy model when it has been trained (faster than the real model `make demo` runs when installed:
    tests/e2e/test_real_model_mesh.py runs that one), else a tiny random one."""
    if (BUNDLED_MODEL / "config.json").is_file():
        return ["--model", BUNDLED_MODEL.name]
    return ["--model", str(tiny_model_path)]


def work_dir_of(stderr: str) -> str:
    match = re.search(r"logs in (\S+)", stderr)
    assert match, f"the demo did not say where its logs are:\n{stderr}"
    return match.group(1)


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (the demo's work directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command_line:
            found.append(int(entry.name))
    return found


def streamed_answer(stdout: str) -> str:
    """The text between the hop-chain header and the `[finish_reason: ...]` summary."""
    match = re.search(r"a change is marked \[\[via \.\.\.\]\]\)\n\n(.*)\n\n\[(?:length|stop)", stdout, re.S)
    assert match, f"no streamed answer in:\n{stdout}"
    return match.group(1)


def test_demo_streams_one_answer_over_three_shard_hosts_and_stops_everything(model_args):
    completed = subprocess.run(demo_command(model_args), cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=demo_timeout_s)
    assert completed.returncode == 0, f"stdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    out = completed.stdout
    chain = re.search(r"^pipeline p-\w+: orchestrator -> (.*) -> orchestrator$", out, re.M)
    assert chain, out
    hosts = chain.group(1).split(" -> ")
    assert [host.split(" ")[0] for host in hosts] == ["demo-host-0", "demo-host-1", "demo-host-2"]
    assert streamed_answer(out).strip(), out
    summary = re.search(r"^\[(length|stop): (\d+) tokens, ", out, re.M)
    assert summary and 1 <= int(summary.group(2)) <= MAX_TOKENS, out
    tokens = int(summary.group(2))
    # Every token ran through all three hosts, and the projector saw the pipeline complete.
    per_host = re.search(r"^steps run per shard host: (.*)$", out, re.M)
    assert per_host, out
    assert re.findall(r"demo-host-\d \[layers [\d-]+\] (\d+)", per_host.group(1)) == [str(tokens)] * 3
    assert re.search(rf"^read model \(hearth projector\): pipeline p-\w+ completed, {tokens} tokens$", out, re.M)
    for step in range(1, 7):
        assert f"[{step}/6]" in completed.stderr
    # Every process's /metrics endpoint is listed: projector, three shard hosts, orchestrator.
    endpoints = re.findall(r"^    (\S+) +http://127\.0\.0\.1:\d+/metrics$", completed.stderr, re.M)
    assert sorted(name.split("-")[0] for name in endpoints) == ["orchestrator", "projector"] + ["shard"] * 3, \
        completed.stderr
    work_dir = work_dir_of(completed.stderr)
    assert processes_mentioning(work_dir) == []
    assert not Path(work_dir).exists(), "the demo's temporary work directory was left behind"


def test_demo_serve_answers_hearth_chat_and_ctrl_c_stops_everything(model_args, tmp_path):
    stdout_path, stderr_path = tmp_path / "demo.out", tmp_path / "demo.err"
    with open(stdout_path, "w") as stdout_file, open(stderr_path, "w") as stderr_file:
        demo = subprocess.Popen(demo_command(model_args, "--serve"), cwd=REPO_ROOT, stdout=stdout_file,
                                stderr=stderr_file, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + serve_ready_timeout_s
        while "Ctrl-C stops everything." not in stdout_path.read_text():
            assert demo.poll() is None, f"{stdout_path.read_text()}\n{stderr_path.read_text()}"
            assert time.monotonic() < deadline, stdout_path.read_text()
            time.sleep(0.2)
        out = stdout_path.read_text()
        try_line = re.search(r"^Try:  hearth (chat .*)$", out, re.M)
        assert try_line, out
        # Run the suggested line as printed.
        chat = subprocess.run([sys.executable, "-m", "hearth.services.cli", *shlex.split(try_line.group(1)),
                               "--max-tokens", "4"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert chat.returncode == 0, chat.stderr
        assert re.search(r"\[(length|stop): \d+ tokens", chat.stderr), chat.stderr
        # And the gateway's curl line, as printed: an OpenAI stream ending with [DONE].
        curl_line = re.search(r"^Try:  (curl -N .*)$", out, re.M)
        assert curl_line and re.search(r"^OpenAI-compatible gateway: export OPENAI_BASE_URL=http", out, re.M), out
        streamed = subprocess.run(["bash", "-c", curl_line.group(1)], capture_output=True, text=True, timeout=60)
        assert streamed.returncode == 0 and streamed.stdout.rstrip().endswith("data: [DONE]"), streamed
        work_dir = work_dir_of(stderr_path.read_text())
        assert len(processes_mentioning(work_dir)) >= 5  # nats-server, projector, 3 shards, orchestrator

        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 0, stderr_path.read_text()
        assert processes_mentioning(work_dir) == []
        assert "interrupted" in stderr_path.read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
            # Its processes run in sessions of their own and outlive a killed demo: a failed run leaves none behind
            # to load the machine for the tests after it.
            logs_at = re.search(r"logs in (\S+)", stderr_path.read_text())
            for pid in processes_mentioning(logs_at.group(1)) if logs_at else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_demo_with_a_missing_model_says_so_and_starts_nothing(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "hearth.services.cli", "demo", "--model", str(tmp_path / "nowhere"), "--shards", "3"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2  # the caller's input
    assert "hearth demo:" in completed.stderr and "nowhere" in completed.stderr
