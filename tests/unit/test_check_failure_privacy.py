"""A hop's check, or an answer's warm-up, that fails on an exception quoting the activations or tokens it handled (as
torch's, numpy's and pydantic's messages may) is logged by its type and where it was raised, never by its message:
activations and answers are never logged."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from hearth.services.orchestrator import answer_kv, mirrored_checks
from hearth.services.orchestrator.answer_kv import AnswerWarmUps
from hearth.services.orchestrator.canaries import CanaryRunner
from hearth.services.transport import FrameKind
from tests.unit.test_verify_gaps import StandInMirror, run_step, verifier_of


class QuotingMirror(StandInMirror):
    """A replica whose check fails, its message quoting the inputs it was fed."""

    quoted: list[float] = []

    async def check(self, span):
        self.quoted = span.inputs.flatten().tolist()
        raise ValueError(f"outputs cannot be compared: {self.quoted}")


async def test_a_failed_check_logs_no_activations(monkeypatch, caplog):
    mirror = QuotingMirror("replica")

    async def open_mirror(ctx, call, chain, index, avoid, chance):
        return mirror

    monkeypatch.setattr(mirrored_checks, "open_mirror", open_mirror)
    verifier, recorder, _ = await verifier_of("all")
    run_step(recorder, 1, FrameKind.prefill, 0, 3)
    caplog.set_level(logging.DEBUG)
    verifier.after_step()
    await verifier.verify_step()
    await verifier.settle()

    failures = [record for record in caplog.records if "failed" in record.getMessage()]
    assert failures, "the failed check is logged"
    logged = caplog.text
    assert "ValueError" in logged and "in check" in logged  # what failed, and where
    assert mirror.quoted and not any(repr(value) in logged for value in mirror.quoted)


async def test_a_failed_answer_warm_up_logs_no_answer(monkeypatch, caplog):
    """An answer's warm-up runs the answer's tokens through a chain: its failure is logged without its message."""
    answer_tokens = [48213, 9021, 77341]

    async def warm_up(ctx, builder, hops):
        raise RuntimeError(f"cannot embed tokens {answer_tokens}")

    monkeypatch.setattr(answer_kv, "warm_up", warm_up)
    caplog.set_level(logging.DEBUG)
    warm_ups = AnswerWarmUps(limit=1)
    warm_ups.start(SimpleNamespace(settings=SimpleNamespace(prefix_cache=SimpleNamespace(warm_up_timeout_s=5.0))),
                   SimpleNamespace(call=SimpleNamespace(pipeline_id="p-warm")), [])
    await asyncio.wait_for(warm_ups.close(), timeout=5)

    assert "p-warm" in caplog.text and "RuntimeError" in caplog.text
    assert not any(str(token) in caplog.text for token in answer_tokens)


async def test_a_failed_canary_replay_logs_no_activations(caplog):
    """A canary is a call's recorded activations: its replay's failure is logged without its message."""
    quoted = [0.731204, -1.284577, 0.055913]
    ctx = SimpleNamespace(settings=SimpleNamespace(verification=SimpleNamespace(canary_interval_s=0.01)))
    runner = CanaryRunner(ctx, record=None)
    replayed = asyncio.Event()

    async def replay_one():
        replayed.set()
        raise ValueError(f"the replay's output does not compare: {quoted}")

    runner.replay_one = replay_one
    caplog.set_level(logging.DEBUG)
    runner.start()
    try:
        await asyncio.wait_for(replayed.wait(), timeout=5)
        await asyncio.sleep(0.05)
    finally:
        await runner.close()

    assert "canary" in caplog.text and "ValueError" in caplog.text
    assert not any(repr(value) in caplog.text for value in quoted)
