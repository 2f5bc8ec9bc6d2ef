"""The soak's judgements (hearth/services/devtools/soak.py, soak_checks.py): how a call is classified, and when a
process's memory counts as trending upward."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.protocol.chat_frames import DoneFrame, ErrorFrame, PipelineAbortedFrame, TokenDeltaFrame
from hearth.services.devtools.soak import ENDING_BOUNDS_S, classify
from hearth.services.devtools.soak_checks import memory_trends, rss_min_judged_load_s, slope_per_minute


@dataclass
class FakeCall:
    frames: list = field(default_factory=list)
    arrived_at: list[float] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def final(self):
        return self.frames[-1] if self.frames else None

    @property
    def answer_token_ids(self) -> list[int]:
        return [f.token_id for f in self.frames if isinstance(f, TokenDeltaFrame)]


def streamed(tokens: list[int], final, ending_after_s: float = 0.1) -> FakeCall:
    frames = [TokenDeltaFrame(seq=i + 1, token_id=t, text="x") for i, t in enumerate(tokens)]
    times = [0.1 * (i + 1) for i in range(len(frames))]
    return FakeCall([*frames, final], [*times, (times[-1] if times else 0.0) + ending_after_s])


def done(seq: int):
    return DoneFrame.model_validate({"type": "done", "seq": seq, "finish_reason": "length",
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


def test_a_done_call_is_identical_only_with_the_reference_tokens():
    assert classify(streamed([1, 2, 3], done(4)), [1, 2, 3], None)[0] == "identical"
    assert classify(streamed([1, 2, 4], done(4)), [1, 2, 3], None)[0] == "wrong"


def test_a_fault_code_within_its_bound_is_documented_and_late_or_other_codes_are_unexplained():
    aborted = PipelineAbortedFrame(seq=3, code="shard_unavailable", reason="no shard covers layers 0-2")
    assert classify(streamed([1, 2], aborted), [1, 2, 3], None)[:2] == ("documented", "shard_unavailable")
    late = streamed([1, 2], aborted, ending_after_s=ENDING_BOUNDS_S["shard_unavailable"] + 1)
    assert classify(late, [1, 2, 3], None)[0] == "unexplained"
    internal = ErrorFrame(seq=1, code="internal_error", message="boom")
    assert classify(streamed([], internal), [1], None)[0] == "unexplained"
    assert classify(FakeCall(), [1], RuntimeError("broken"))[0] == "unexplained"


def test_slope_is_per_minute():
    assert slope_per_minute([(0.0, 10.0), (30.0, 11.0), (60.0, 12.0)]) == 2.0
    assert slope_per_minute([(5.0, 1.0)]) == 0.0


def samples(name: str, pid: int, values: list[float], every_s: float) -> list[dict]:
    return [{"t_s": i * every_s, "process": name, "pid": pid, "rss_mib": v} for i, v in enumerate(values)]


def test_memory_rising_in_the_second_half_trends_upward_and_flat_memory_does_not():
    load_s = rss_min_judged_load_s
    every_s = load_s / 19
    rising = samples("leaky", 1, [100 + 10 * i for i in range(20)], every_s)
    warming = samples("warm", 2, [100 + 50 * min(i, 5) for i in range(20)], every_s)
    brief = samples("restarted", 3, [100 + 10 * i for i in range(20)], every_s / 4)
    trends = {trend["process"]: trend for trend in memory_trends(rising + warming + brief, load_s)}
    assert trends["leaky"]["upward"] and not trends["warm"]["upward"]
    assert "restarted" not in trends  # ran too short a share of the load to judge
    short = memory_trends(samples("leaky", 1, [100 + 10 * i for i in range(20)], 6.0), 120.0)
    assert not short[0]["upward"]  # a two-minute load is reported, not judged
