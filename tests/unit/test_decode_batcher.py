"""DecodeBatcher (services/shard/batcher.py): steps ready together run as one batch, a lone hop never waits for
the window, rows of other layer sub-ranges wait for their own batch, and a row's exception reaches only its hop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.shard.batcher import DecodeBatcher

LONG_WINDOW_S = 30.0


def hop(name: str, layers: tuple[int, int] = (0, 5)):
    return SimpleNamespace(session_id=name, layer_lo=layers[0], layer_hi=layers[1])


class Recorder:
    """A run_batch that records each batch's sessions and answers each row with its session id."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def __call__(self, batch):
        self.batches.append([queued.request.session_id for queued in batch])
        return [ValueError(q.request.session_id) if q.request.session_id == "bad" else q.request.session_id
                for q in batch]


async def test_steps_of_every_open_hop_run_as_one_batch():
    recorder = Recorder()
    batcher = DecodeBatcher(recorder, window_s=LONG_WINDOW_S, max_sessions=8, open_hops=lambda: 3)
    results = await asyncio.wait_for(asyncio.gather(*(batcher.submit(hop(n), None) for n in "abc")), timeout=5)
    assert results == ["a", "b", "c"]
    assert recorder.batches == [["a", "b", "c"]]  # the window ended as soon as every open hop had a step queued


async def test_a_lone_hop_does_not_wait_for_the_window():
    recorder = Recorder()
    batcher = DecodeBatcher(recorder, window_s=LONG_WINDOW_S, max_sessions=8, open_hops=lambda: 1)
    assert await asyncio.wait_for(batcher.submit(hop("a"), None), timeout=5) == "a"


async def test_batches_hold_one_layer_range_and_at_most_max_sessions():
    recorder = Recorder()
    batcher = DecodeBatcher(recorder, window_s=0.0, max_sessions=2, open_hops=lambda: 4)
    steps = [batcher.submit(hop("a"), None), batcher.submit(hop("x", (0, 2)), None),
             batcher.submit(hop("b"), None), batcher.submit(hop("c"), None)]
    assert await asyncio.wait_for(asyncio.gather(*steps), timeout=5) == ["a", "x", "b", "c"]
    assert recorder.batches == [["a", "b"], ["x"], ["c"]]


async def test_a_row_s_exception_reaches_only_its_own_hop():
    batcher = DecodeBatcher(Recorder(), window_s=0.0, max_sessions=8, open_hops=lambda: 2)
    good, bad = await asyncio.gather(batcher.submit(hop("good"), None), batcher.submit(hop("bad"), None),
                                     return_exceptions=True)
    assert good == "good" and isinstance(bad, ValueError)
    await batcher.close()


def test_settings_are_validated():
    with pytest.raises(ValueError):
        DecodeBatcher(Recorder(), window_s=-1.0, max_sessions=8, open_hops=lambda: 1)
    with pytest.raises(ValueError):
        DecodeBatcher(Recorder(), window_s=0.0, max_sessions=0, open_hops=lambda: 1)
