"""`hearth chat` waits for frames as the configuration's [client] section says, like the gateway does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from hearth.services.broker.connection import flush_ordered
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT

pytestmark = pytest.mark.integration
HEARTH = str(Path(sys.executable).parent / "hearth")


async def test_hearth_chat_gives_up_on_a_silent_orchestrator_after_the_configured_first_frame_timeout(nats_url,
                                                                                                     tmp_path):
    """Before, `hearth chat` waited its built-in 10 s whatever [client] first_frame_timeout_s said."""
    config = tmp_path / "hearth.toml"
    config.write_text("[client]\nfirst_frame_timeout_s = 0.4\n")
    silent = await nats.connect(nats_url)
    try:
        await silent.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators")  # takes every call, answers none
        await flush_ordered(silent)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("HEARTH_")}, "HEARTH_NATS__INSECURE": "1"}
        completed = await asyncio.to_thread(
            subprocess.run, [HEARTH, "--config", str(config), "chat", "--nats", nats_url, "hello"],
            capture_output=True, text=True, env=env, timeout=60)
    finally:
        await silent.close()
    assert completed.returncode != 0, completed.stderr
    assert "no frame and no keepalive from the orchestrator for 0.4 s" in completed.stderr, completed.stderr
