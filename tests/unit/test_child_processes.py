"""Children that end with their starter: a preexec_fn only where the kernel's parent-death signal is safe to ask."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hearth.services.common.child_processes import ends_with_this_process

child_timeout_s = 30.0


def test_from_another_thread_only_the_other_preexec_fn_is_given():
    """A thread's end would signal the child: a worker thread's children are left as they are."""
    def pin() -> None:
        return None

    given: list[object] = []
    worker = threading.Thread(target=lambda: given.extend([ends_with_this_process(), ends_with_this_process(pin)]))
    worker.start()
    worker.join(timeout=child_timeout_s)
    assert given == [None, pin]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_ends_when_its_starter_is_killed():
    starter_code = textwrap.dedent("""
        import subprocess, sys, time
        from hearth.services.common.child_processes import ends_with_this_process
        child = subprocess.Popen(["sleep", "60"], preexec_fn=ends_with_this_process())
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    starter = subprocess.Popen([sys.executable, "-c", starter_code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(starter.stdout.readline())
    starter.send_signal(signal.SIGKILL)
    starter.wait(timeout=child_timeout_s)
    deadline = time.monotonic() + child_timeout_s
    while Path(f"/proc/{child}/cmdline").exists() and b"sleep" in Path(f"/proc/{child}/cmdline").read_bytes():
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the child outlived its killed starter")
        time.sleep(0.05)
