"""A command stopped by SIGTERM (run_cancelling_on_signal) ends even when a library drops the cancellation the signal
sent: the cancellation is sent again until the command ends."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from hearth.services.common import lifecycle
from hearth.services.common.lifecycle import Interrupted, run_cancelling_on_signal


def test_a_command_that_drops_the_first_cancellation_is_cancelled_again(monkeypatch):
    monkeypatch.setattr(lifecycle, "stop_repeat_s", 0.1)
    cancellations = []

    async def command_dropping_one_cancellation() -> str:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # as nats-py's request does on Python 3.11, now and then
            cancellations.append("dropped")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancellations.append("kept")
            raise
        return "finished"

    with pytest.raises(Interrupted):
        run_cancelling_on_signal(command_dropping_one_cancellation())
    assert cancellations == ["dropped", "kept"]
