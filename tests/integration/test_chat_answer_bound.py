"""`hearth chat` ends an answer past its request's bound (hearth/services/client/answer_bound.py) that a hostile
orchestrator streams: one error line, a WARNING naming the call, exit code 1, and none of the text past the bound."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT

pytestmark = pytest.mark.integration
HEARTH = str(Path(sys.executable).parent / "hearth")


async def test_hearth_chat_ends_a_hostile_orchestrator_s_answer_at_max_tokens(nats_url):
    hostile = await nats.connect(nats_url)
    requests: list[dict] = []

    async def answer(msg) -> None:
        requests.append(json.loads(msg.data))
        for seq in range(1000):  # far more tokens than the call's max_tokens 2
            frame = {"type": "token_delta", "seq": seq, "text": "ok" if seq < 2 else "LEAK", "token_id": 1}
            await hostile.publish(msg.reply, json.dumps(frame).encode())

    try:
        await hostile.subscribe(CHAT_REQUEST_SUBJECT, queue="hearth-orchestrators", cb=answer)
        await hostile.flush()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("HEARTH_")}, "HEARTH_NATS__INSECURE": "1"}
        completed = await asyncio.to_thread(
            subprocess.run, [HEARTH, "chat", "--nats", nats_url, "--max-tokens", "2", "hello"],
            capture_output=True, text=True, env=env, timeout=60)
    finally:
        await hostile.close()
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout == "okok\n"
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error ")]
    assert errors == ["error answer_too_long: the orchestrator sent choice 0 more token frames than the request's "
                      "max_tokens 2: no correct orchestrator does, so the call was ended"], completed.stderr
    warnings = [line for line in completed.stderr.splitlines() if "WARNING hearth.services.client" in line]
    assert len(warnings) == 1 and requests[0]["request_id"] in warnings[0], completed.stderr
