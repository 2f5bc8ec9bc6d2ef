"""The latency relay's timer correction (hearth/services/devtools/netbed_relay.py, TimerLateness): one wake-up made late
by a load spike must not leave the link without its delay afterwards; chunks that then leave early pull the
correction back."""

from __future__ import annotations

import asyncio

from hearth.services.devtools.netbed_relay import TimerLateness

spiked_correction_s = 0.05
one_way_delay_s = 0.02
chunks = 30


async def test_a_correction_raised_by_a_late_wake_up_comes_back_down():
    lateness = TimerLateness()
    # As after one wake-up 0.5 s late: larger than the link's whole one-way delay.
    lateness.correction_s = spiked_correction_s
    loop = asyncio.get_running_loop()
    for _ in range(chunks):
        await lateness.sleep_until(loop.time() + one_way_delay_s)
    assert 0.0 <= lateness.correction_s < spiked_correction_s


async def test_a_chunk_already_due_leaves_the_correction_alone():
    lateness = TimerLateness()
    lateness.correction_s = 0.001
    await lateness.sleep_until(asyncio.get_running_loop().time() - 1.0)
    assert lateness.correction_s == 0.001
