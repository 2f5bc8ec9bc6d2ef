"""The compute thread (one OpenMP team per process) and the event loop every hearth process runs on."""

import asyncio
import threading

import pytest
import torch

from hearth.inference.compute_thread import (COMPUTE_THREAD_NAME, StepThreads, on_compute_thread,
                                     parallel_batch_min_weight_bytes, use_intra_op_threads)
from hearth.services.common.lifecycle import EVENT_LOOP_ENV, run_event_loop


def test_every_call_runs_on_the_same_named_thread_off_the_event_loop() -> None:
    async def main() -> set[str]:
        loop_thread = threading.current_thread().name
        names = await asyncio.gather(*(on_compute_thread(lambda: threading.current_thread().name) for _ in range(8)))
        assert loop_thread not in names
        return set(names)

    names = asyncio.run(main())
    assert len(names) == 1 and next(iter(names)).startswith(COMPUTE_THREAD_NAME)


def test_arguments_results_and_exceptions_cross_the_thread() -> None:
    async def main() -> torch.Tensor:
        with pytest.raises(ZeroDivisionError):
            await on_compute_thread(lambda: 1 / 0)
        return await on_compute_thread(torch.full, (2,), fill_value=3.0)

    assert torch.equal(asyncio.run(main()), torch.tensor([3.0, 3.0]))


def test_services_run_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert run_event_loop(loop_module()).startswith("uvloop")
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert run_event_loop(loop_module()).startswith("asyncio")


def test_step_threads_narrow_only_while_several_streams_are_served() -> None:
    alone = torch.get_num_threads()
    assert StepThreads().for_streams(4) == alone, "without busy_threads nothing changes"
    policy = StepThreads(busy_threads=1)
    assert [policy.for_streams(n) for n in (0, 1, 2, 5)] == [alone, alone, 1, 1]
    assert StepThreads(busy_threads=alone + 8).for_streams(3) == alone, "never more threads than alone"
    with pytest.raises(ValueError):
        StepThreads(busy_threads=0)


def test_a_large_batched_step_holding_every_stream_gets_all_threads() -> None:
    alone = torch.get_num_threads()
    policy = StepThreads(busy_threads=1)
    large, small = parallel_batch_min_weight_bytes, parallel_batch_min_weight_bytes - 1
    assert policy.for_step(rows=8, active_streams=8, weight_bytes=large) == alone
    assert policy.for_step(rows=1, active_streams=1, weight_bytes=small) == alone
    assert policy.for_step(rows=8, active_streams=8, weight_bytes=small) == 1, "small products: not worth splitting"
    assert policy.for_step(rows=4, active_streams=8, weight_bytes=large) == 1, "other streams' hops run beside it"
    assert StepThreads().for_step(rows=4, active_streams=8, weight_bytes=large) == alone


def test_the_thread_count_is_set_on_the_compute_thread() -> None:
    async def main() -> tuple[int, int]:
        await on_compute_thread(use_intra_op_threads, 1)
        narrowed = await on_compute_thread(torch.get_num_threads)
        await on_compute_thread(use_intra_op_threads, 2)
        return narrowed, await on_compute_thread(torch.get_num_threads)

    assert asyncio.run(main()) == (1, 2)
