"""A step run a few layers at a time (LayerRangeRunner.begin_forward / advance, hearth/inference/layer_pass.py) equals
the same step run whole, bitwise, for every tiny architecture, also when another session's steps run between its
slices; a session evicted between slices makes the next slice raise SessionEvictedError and leaves no half cache;
a shard runs the turns of a long prefill on a thread of lower CPU priority ([shard] prefill_nice), its other steps on
the compute thread."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from hearth.inference import SamplingParams, SessionEvictedError, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS

from hearth.inference.compute_thread import on_compute_thread
from hearth.services.common.config import ShardSettings
from hearth.protocol.control import OpenHop
from hearth.services.shard.compute import ShardCompute, runner_session
from hearth.services.transport import FrameKind, ReceivedStep
from hearth.services.transport.frames import encode_step
from hearth.services.transport.headers import StepInfo

from .inference_tiny_models import ARCHITECTURES, TINY_NUM_LAYERS, one_torch_thread, tiny_model_dir  # noqa: F401

PROMPT = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox"


def run_sliced(runner, session_id: str, hidden: torch.Tensor, start_pos: int, kind: str, slice_layers: int,
               between=None, piece_tokens: int | None = None) -> torch.Tensor:
    step = runner.begin_forward(session_id, hidden, start_pos, kind)
    turns = 0
    while (output := runner.advance(step, slice_layers, piece_tokens)) is None:
        turns += 1
        if between is not None:
            between()
    pieces = -(-hidden.shape[1] // piece_tokens) if piece_tokens else 1
    assert turns == pieces * -(-runner.num_layers // slice_layers) - 1  # really run in turns, not whole
    return output


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sliced_prefill_and_decode_equal_whole_steps_bitwise(tiny_model_dir, architecture):
    path = tiny_model_dir(architecture)
    head = load_head(path)
    whole, sliced = (load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS) for _ in range(2))
    prompt_ids = head.tokenizer.encode(PROMPT)
    other_ids = head.tokenizer.encode("an unrelated session")
    sliced.forward("other", head.embed(other_ids), 0, "prefill")
    other_position = len(other_ids)

    def other_session_decodes() -> None:
        nonlocal other_position
        sliced.forward("other", head.embed([7]), other_position, "decode")
        other_position += 1

    # Chunked like the orchestrator's prefill: the second chunk continues a cache the first one filled in slices.
    split = len(prompt_ids) // 2
    for start, chunk in ((0, prompt_ids[:split]), (split, prompt_ids[split:])):
        expected = whole.forward("s", head.embed(chunk), start, "prefill")
        got = run_sliced(sliced, "s", head.embed(chunk), start, "prefill", 2, between=other_session_decodes)
        assert torch.equal(got, expected)
    position = len(prompt_ids)
    for _ in range(4):
        token = head.sample(head.logits(expected), SamplingParams(temperature=0.0))
        expected = whole.forward("s", head.embed([token]), position, "decode")
        got = run_sliced(sliced, "s", head.embed([token]), position, "decode", 1, between=other_session_decodes)
        assert torch.equal(got, expected)
        position += 1
    assert sliced.cached_tokens("s") == whole.cached_tokens("s") == position


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma2"])
def test_a_step_in_token_pieces_equals_the_pieces_sent_as_steps_bitwise(tiny_model_dir, architecture):
    """Pieces of 5 tokens, a layer per turn: the same arithmetic as the orchestrator sending 5-token chunks."""
    path = tiny_model_dir(architecture)
    head = load_head(path)
    chunked, pieced = (load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS) for _ in range(2))
    prompt = head.embed(head.tokenizer.encode(PROMPT))
    pieces = [chunked.forward("s", prompt[:, start:start + 5], start, "prefill")
              for start in range(0, prompt.shape[1], 5)]
    got = run_sliced(pieced, "s", prompt, 0, "prefill", 1, piece_tokens=5)
    assert torch.equal(got, torch.cat(pieces, dim=1))
    assert pieced.cached_tokens("s") == prompt.shape[1]


def test_a_session_evicted_between_slices_raises_and_keeps_no_half_cache(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    step = runner.begin_forward("s", head.embed(head.tokenizer.encode(PROMPT)), 0, "prefill")
    assert runner.advance(step, 2) is None
    runner.reset("s")
    with pytest.raises(SessionEvictedError, match="in the middle of a step"):
        runner.advance(step, 2)
    assert runner.cached_tokens("s") == 0

    # Restarted meanwhile (a new prefill at 0 replaced the record): the old step must not write into the new cache.
    step = runner.begin_forward("s", head.embed([5, 6, 7]), 0, "prefill")
    assert runner.advance(step, 3) is None
    runner.forward("s", head.embed([5, 6]), 0, "prefill")
    with pytest.raises(SessionEvictedError):
        runner.advance(step, 3)


def test_advancing_a_finished_step_is_refused(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, 1, **RUNNER_KV_LIMITS)
    step = runner.begin_forward("s", head.embed([5, 6, 7]), 0, "prefill")
    assert runner.advance(step) is not None
    with pytest.raises(RuntimeError, match="already run its last layer"):
        runner.advance(step)


def shard_settings(**fields) -> ShardSettings:
    """A shard's settings with batching, slicing, pieces and the niced thread off but for `fields`."""
    off = dict(max_batch_sessions=1, batch_window_ms=0.0, batch_merge_window_ms=0.0, prefill_slice_layers=0,
               prefill_slice_min_tokens=1, prefill_slice_tokens=0, prefill_nice=0)
    return ShardSettings(**{**off, **fields})


def _received(session_id: str, kind: FrameKind, pos: int, tensor: torch.Tensor) -> ReceivedStep:
    header = encode_step(StepInfo(session=session_id, step=0, kind=kind, pos=pos), tensor).header("p1", 0, 0)
    return ReceivedStep(header, tensor, None, 0, None, 0.0)


def _open_hop(session_id: str, hi: int) -> OpenHop:
    return OpenHop(pipeline_id="p1", session_id=session_id, hop=0, hop_count=1, model_id="tiny",
                   weights_sha256="0" * 64, layer_lo=0, layer_hi=hi)


@pytest.mark.parametrize("kind", [FrameKind.prefill, FrameKind.replay])
@pytest.mark.parametrize("prefill_slice_layers", [0, 1])
async def test_a_shards_steps_run_between_the_slices_of_a_long_prefill(tiny_model_dir, prefill_slice_layers, kind):
    """The compute thread is held while three steps queue: a long prefill (or replay of decoded tokens), then a short
    call's decode step. Sliced, the decode step runs after the long step's first slice and ends first; whole, it waits
    for the whole long step. Either way the long step's output is the runner's for that step."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    reference = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    runner.forward(runner_session(_open_hop("short", TINY_NUM_LAYERS - 1)), head.embed([5, 6, 7]), 0, "prefill")
    long_pos = 0 if kind is FrameKind.prefill else 2  # a replay continues a session
    if long_pos:
        runner.forward(runner_session(_open_hop("long", TINY_NUM_LAYERS - 1)), head.embed([5, 6]), 0, "prefill")
        reference.forward("long", head.embed([5, 6]), 0, "prefill")
    compute = ShardCompute(runner, "shard-0", shard_settings(prefill_slice_layers=prefill_slice_layers,
                                                             prefill_slice_min_tokens=8))
    long_input = head.embed(head.tokenizer.encode(PROMPT * 2))
    expected_long = reference.forward("long", long_input, long_pos, kind.value)
    held = threading.Event()
    blocker = asyncio.ensure_future(on_compute_thread(held.wait, 10.0))
    finished: list[str] = []

    async def step(name: str, kind: FrameKind, pos: int, tensor: torch.Tensor):
        result = await compute.run(_open_hop(name, TINY_NUM_LAYERS - 1), _received(name, kind, pos, tensor))
        finished.append(name)
        return result

    long_step = asyncio.ensure_future(step("long", kind, long_pos, long_input))
    await asyncio.sleep(0)  # the long step's first trip is queued on the compute thread before the short step's
    short_step = asyncio.ensure_future(step("short", FrameKind.decode, 3, head.embed([8])))
    await asyncio.sleep(0)
    held.set()
    long_result, _ = await asyncio.wait_for(asyncio.gather(long_step, short_step), timeout=30)
    await blocker
    assert finished == (["short", "long"] if prefill_slice_layers else ["long", "short"])
    assert torch.equal(long_result.output, expected_long)


def _own_nice() -> tuple[int, int]:
    thread_id = threading.get_native_id()
    return thread_id, os.getpriority(os.PRIO_PROCESS, thread_id)


async def test_a_long_prefill_runs_on_a_niced_thread_and_the_other_steps_on_the_compute_thread(tiny_model_dir):
    """Where the layers really ran (a hook on the first layer's input norm, which one-token steps on the lean path call
    too, notes the thread and its nice value): the long prefill's turns on a thread `prefill_nice` below the compute
    thread, a short prefill and a decode step on the compute thread; the long prefill's output is still bitwise the
    whole step's."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    ran_on: list[tuple[int, int]] = []
    assert runner.lean_decode  # checked now, so that the hook sees the steps alone
    runner._stack.layers[0].input_layernorm.register_forward_pre_hook(lambda module, args: ran_on.append(_own_nice()))
    compute = ShardCompute(runner, "shard-0", shard_settings(prefill_slice_layers=1, prefill_slice_min_tokens=8,
                                                             prefill_nice=5))
    compute_thread, compute_nice = await on_compute_thread(_own_nice)
    long_prompt = head.embed(head.tokenizer.encode(PROMPT * 2))
    expected_long = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS).forward(
        "long", long_prompt, 0, "prefill")

    long_result = await compute.run(_open_hop("long", TINY_NUM_LAYERS - 1),
                                    _received("long", FrameKind.prefill, 0, long_prompt))
    prefill_threads = set(ran_on)
    ran_on.clear()
    await compute.run(_open_hop("short", TINY_NUM_LAYERS - 1), _received("short", FrameKind.prefill, 0,
                                                                          head.embed([5, 6, 7])))
    await compute.run(_open_hop("short", TINY_NUM_LAYERS - 1), _received("short", FrameKind.decode, 3,
                                                                          head.embed([8])))

    assert torch.equal(long_result.output, expected_long)
    assert len(prefill_threads) == 1
    (prefill_thread, prefill_nice), = prefill_threads
    assert prefill_thread != compute_thread and prefill_nice == min(19, compute_nice + 5)
    assert ran_on == [(compute_thread, compute_nice)] * 2


async def test_the_compute_threads_steps_run_while_a_prefill_turn_is_under_way(tiny_model_dir):
    """A turn of the long prefill is held inside its first layer; another session's decode step still runs to its end
    on the compute thread meanwhile (the runner's lock is not held while layers run), and both outputs are bitwise
    what they are run alone."""
    path = tiny_model_dir("llama")
    head = load_head(path)
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    runner.forward(runner_session(_open_hop("short", TINY_NUM_LAYERS - 1)), head.embed([5, 6, 7]), 0, "prefill")
    reference = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    reference.forward("short", head.embed([5, 6, 7]), 0, "prefill")
    expected_short = reference.forward("short", head.embed([8]), 3, "decode")
    long_prompt = head.embed(head.tokenizer.encode(PROMPT * 2))
    expected_long = reference.forward("long", long_prompt, 0, "prefill")
    compute = ShardCompute(runner, "shard-0", shard_settings(prefill_slice_layers=1, prefill_slice_min_tokens=8,
                                                             prefill_nice=5))
    compute_thread, _ = await on_compute_thread(_own_nice)
    in_turn, release = threading.Event(), threading.Event()

    def hold_the_first_prefill_turn(module, args):
        if threading.get_native_id() != compute_thread and not in_turn.is_set():
            in_turn.set()
            assert release.wait(10.0)

    runner._stack.layers[0].register_forward_pre_hook(hold_the_first_prefill_turn)
    long_step = asyncio.ensure_future(compute.run(_open_hop("long", TINY_NUM_LAYERS - 1),
                                                  _received("long", FrameKind.prefill, 0, long_prompt)))
    try:
        assert await asyncio.to_thread(in_turn.wait, 10.0)
        short_result = await asyncio.wait_for(compute.run(_open_hop("short", TINY_NUM_LAYERS - 1),
                                                          _received("short", FrameKind.decode, 3, head.embed([8]))),
                                              timeout=10.0)
        assert not long_step.done()
    finally:
        release.set()
    long_result = await asyncio.wait_for(long_step, timeout=30.0)
    assert torch.equal(short_result.output, expected_short)
    assert torch.equal(long_result.output, expected_long)
