"""Kept prefixes of LayerRangeRunner: a session attached to an ended one's blocks continues exactly where a session
that computed them itself would, shorter matches and other layers miss, and kept blocks give way to live sessions;
in dynamic caches and in static ones (a GPU's, run here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from hearth.inference import load_head, load_layer_range
from hearth.inference.prefix_cache import PrefixCache, prefix_keys
from tests.runner_limits import RUNNER_KV_LIMITS

from .inference_tiny_models import (  # noqa: F401  (fixtures)
    ARCHITECTURES,
    TINY_NUM_LAYERS,
    TINY_SLIDING_WINDOW,
    one_torch_thread,
    tiny_model_dir,
)

BLOCK = 4
PROMPT = [1, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]  # 11 tokens: two whole blocks and three more


# Positions of a static cache in these tests (the runner serves no session longer).
STATIC_TOKENS = 64


@pytest.fixture(params=[("llama", None), ("qwen2", None), ("llama", STATIC_TOKENS)],
                ids=["llama", "qwen2", "llama-static"])
def model(request, tiny_model_dir):
    architecture, static_tokens = request.param
    path = tiny_model_dir(architecture)
    return path, load_head(path), static_tokens


def runner_of(model, **limits):
    path, _, static_tokens = model
    return load_layer_range(path, 0, 1, prefix_ttl_s=600.0, static_cache_tokens=static_tokens,
                            **(RUNNER_KV_LIMITS | limits))


def test_a_session_attached_to_kept_blocks_continues_as_if_it_had_computed_them(model):
    path, head, _ = model
    runner = runner_of(model)
    whole = runner.forward("first", head.embed(PROMPT), 0, "prefill")
    assert runner.keep_prefix("first", ["b0", "b1"], BLOCK) == 2 * BLOCK
    assert "first" not in runner.session_ids()

    assert runner.attach_prefix("second", ["b0", "b1", "b2"], BLOCK) == 2 * BLOCK
    rest = runner.forward("second", head.embed(PROMPT[2 * BLOCK:]), 2 * BLOCK, "prefill")
    torch.testing.assert_close(rest, whole[:, 2 * BLOCK:], rtol=1e-4, atol=1e-4)
    # The kept entry is copied, not lent: a second session attached to it sees the same blocks.
    assert runner.attach_prefix("third", ["b0", "b1"], BLOCK) == 2 * BLOCK
    again = runner.forward("third", head.embed(PROMPT[2 * BLOCK:]), 2 * BLOCK, "prefill")
    torch.testing.assert_close(again, rest, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["prefill", "replay"])
def test_a_first_step_may_start_before_the_attached_end(model, kind):
    # Another hop of the chain held fewer blocks: every hop starts where the one holding least ends. A re-prefill
    # whose kept blocks reach past the prompt begins with a replay step.
    path, head, _ = model
    runner = runner_of(model)
    whole = runner.forward("first", head.embed(PROMPT), 0, "prefill")
    runner.keep_prefix("first", ["b0", "b1"], BLOCK)
    assert runner.attach_prefix("second", ["b0", "b1"], BLOCK) == 2 * BLOCK
    rest = runner.forward("second", head.embed(PROMPT[BLOCK:]), BLOCK, kind)
    torch.testing.assert_close(rest, whole[:, BLOCK:], rtol=1e-4, atol=1e-4)
    assert runner.cached_tokens("second") == len(PROMPT)


def test_other_blocks_other_layers_and_other_block_sizes_miss(model):
    path, head, _ = model
    runner = runner_of(model)
    runner.forward("first", head.embed(PROMPT), 0, "prefill")
    runner.keep_prefix("first", ["b0", "b1"], BLOCK)
    # A block's name opens its KV only behind the names of every block before it (one name learnt is not enough).
    assert runner.attach_prefix("a", ["x0", "b1"], BLOCK) == 0
    assert runner.attach_prefix("b", ["b0", "x1"], BLOCK) == BLOCK
    assert runner.attach_prefix("c", ["b0", "b1"], BLOCK, layers=(1, 1)) == 0
    assert runner.attach_prefix("d", ["b0", "b1"], 2 * BLOCK) == 0
    cache = runner.prefix_cache
    assert (cache.hits_total, cache.misses_total) == (1, 3)


def test_blocks_kept_for_one_opener_are_attached_by_its_sessions_only(model):
    path, head, _ = model
    runner = runner_of(model)
    runner.forward("first", head.embed(PROMPT), 0, "prefill")
    assert runner.keep_prefix("first", ["b0", "b1"], BLOCK, opener="mallory") == 2 * BLOCK
    # Another member's hop, or one of an open mesh, computing the same names finds nothing of it.
    assert runner.attach_prefix("victim", ["b0", "b1"], BLOCK, opener="victor") == 0
    assert runner.attach_prefix("anyone", ["b0", "b1"], BLOCK) == 0
    assert runner.attach_prefix("own", ["b0", "b1"], BLOCK, opener="mallory") == 2 * BLOCK


def test_only_whole_blocks_the_session_holds_are_kept(model):
    path, head, _ = model
    runner = runner_of(model)
    runner.forward("first", head.embed(PROMPT[:6]), 0, "prefill")
    assert runner.keep_prefix("first", ["b0", "b1", "b2"], BLOCK) == BLOCK
    assert runner.keep_prefix("never-run", ["b0"], BLOCK) == 0
    assert runner.attach_prefix("second", ["b0", "b1"], BLOCK) == BLOCK


def test_a_decode_step_after_an_attach_must_continue_exactly(model):
    path, head, _ = model
    runner = runner_of(model)
    runner.forward("first", head.embed(PROMPT), 0, "prefill")
    runner.keep_prefix("first", ["b0", "b1"], BLOCK)
    runner.attach_prefix("second", ["b0", "b1"], BLOCK)
    with pytest.raises(Exception, match="cached tokens"):
        runner.forward("second", head.embed([5]), BLOCK, "decode")


def test_kept_blocks_give_way_to_live_sessions(model):
    path, head, _ = model
    runner = runner_of(model)
    runner.forward("first", head.embed(PROMPT), 0, "prefill")
    runner.keep_prefix("first", ["b0", "b1"], BLOCK)
    kept = runner.prefix_cache.total_bytes
    assert kept > 0
    # A dynamic session grows past the room the kept blocks leave; a static one takes its whole cache at once.
    budget = kept * 2 if runner.static_session_bytes is None else runner.static_session_bytes + kept // 2
    small = runner_of(model, cache_budget_bytes=budget, session_ttl_s=600)
    small.forward("first", head.embed(PROMPT), 0, "prefill")
    small.keep_prefix("first", ["b0", "b1"], BLOCK)
    small.forward("live", head.embed(PROMPT + [5]), 0, "prefill")  # with the kept blocks, over budget
    assert len(small.prefix_cache) == 0 and small.prefix_cache.evictions_total == 1
    assert "live" in small.session_ids()


def test_a_copy_that_cannot_fit_beside_the_live_sessions_is_not_kept_and_pushes_out_nothing(tiny_model_dir):
    # A live session's copy (a request's `n` choices share its prompt's blocks so) larger than the room its own and the
    # other live sessions leave: kept, it would push out every other kept prefix (least recently used first) and then
    # itself, leaving nothing.
    model = (tiny_model_dir("llama"), load_head(tiny_model_dir("llama")), None)
    _, head, _ = model
    probe = runner_of(model)
    probe.forward("probe", head.embed(PROMPT), 0, "prefill")
    per_token = probe.session_bytes("probe") // len(PROMPT)
    small = runner_of(model, cache_budget_bytes=16 * per_token, session_ttl_s=600)
    small.forward("other", head.embed(PROMPT[:BLOCK]), 0, "prefill")
    assert small.keep_prefix("other", ["o0"], BLOCK) == BLOCK
    small.forward("live", head.embed(PROMPT), 0, "prefill")  # 11 positions live beside 4 kept: 15 of 16
    assert small.keep_prefix("live", ["b0", "b1"], BLOCK, end_session=False) == 0  # 8 more would not fit
    assert small.attach_prefix("again", ["o0"], BLOCK) == BLOCK
    assert "live" in small.session_ids()


def test_a_static_session_s_whole_cache_is_made_room_for_before_it_is_taken(tiny_model_dir):
    # A static cache takes all its positions at its first step: kept blocks that would leave no room for it go first.
    path = tiny_model_dir("llama")
    head = load_head(path)
    probe = runner_of((path, head, STATIC_TOKENS))
    probe.forward("first", head.embed(PROMPT), 0, "prefill")
    probe.keep_prefix("first", ["b0", "b1"], BLOCK)
    kept, one_session = probe.prefix_cache.total_bytes, probe.static_session_bytes
    roomy = runner_of((path, head, STATIC_TOKENS), cache_budget_bytes=one_session + kept)
    tight = runner_of((path, head, STATIC_TOKENS), cache_budget_bytes=one_session + kept // 2)
    for runner in (roomy, tight):
        runner.forward("first", head.embed(PROMPT), 0, "prefill")
        runner.keep_prefix("first", ["b0", "b1"], BLOCK)
    assert roomy.attach_prefix("second", ["b0", "b1"], BLOCK) == 2 * BLOCK
    assert tight.attach_prefix("second", ["b0", "b1"], BLOCK) == 0
    assert tight.prefix_cache.evictions_total == 1
    tight.forward("second", head.embed(PROMPT), 0, "prefill")
    assert tight.cache_bytes <= tight.cache_budget_bytes


def test_a_conversation_s_next_turn_replaces_its_earlier_entry_and_branches_stay():
    clock = [0.0]
    cache = PrefixCache(ttl_s=10, clock=lambda: clock[0])
    kv = {0: (torch.zeros(1, 1, 8, 2), torch.zeros(1, 1, 8, 2))}
    cache.put(["a", "b"], kv, 4)
    cache.put(["a", "b", "c"], kv, 4)
    assert len(cache) == 1
    cache.put(["a", "x"], kv, 4)
    assert len(cache) == 2 and cache.lookup(["a", "b", "c", "d"])[1] == 3 and cache.lookup(["a", "x"])[1] == 2
    clock[0] = 11
    cache.lookup(["a", "x"])
    assert cache.evict_expired() > 0 and len(cache) == 1 and cache.lookup(["a", "b", "c"])[1] == 1


def test_a_block_s_name_opens_its_kv_only_after_every_block_before_it():
    cache = PrefixCache(ttl_s=10, clock=lambda: 0.0)
    kv = {0: (torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2))}
    cache.put(["a", "b", "c"], kv, 4)
    # One name learnt somewhere, behind junk: nothing of the entry is found (its first blocks' names are not "x", "y").
    assert cache.lookup(["x", "y", "c"]) is None
    assert cache.lookup(["a", "y", "c"])[1] == 1
    assert cache.lookup(["a", "b", "c"])[1] == 3


def test_shard_keys_depend_on_layers_and_block_size():
    assert prefix_keys(["h"], 0, 3, 16) != prefix_keys(["h"], 0, 4, 16) != prefix_keys(["h"], 0, 4, 32)
    assert prefix_keys(["h", "i"], 0, 3, 16)[0] == prefix_keys(["h"], 0, 3, 16)[0]


def test_shard_keys_depend_on_the_opener():
    keys = {tuple(prefix_keys(["h"], 0, 3, 16, opener)) for opener in (None, "", "ann", "bob", "ann\0")}
    assert len(keys) == 5


def greedy(runner, head, session_id: str, ids: list[int], steps: int, start: int = 0) -> list[int]:
    """Greedy tokens after `ids` (positions from `start` already held by the session); as a call does, the last one
    is never fed back."""
    hidden = runner.forward(session_id, head.embed(ids[start:]), start, "prefill")
    tokens = [int(torch.argmax(head.logits(hidden[:, -1:])))]
    for position in range(len(ids), len(ids) + steps - 1):
        hidden = runner.forward(session_id, head.embed(tokens[-1:]), position, "decode")
        tokens.append(int(torch.argmax(head.logits(hidden[:, -1:]))))
    return tokens


@pytest.mark.parametrize("first_turn_tokens", [5, 12], ids=["inside-the-window", "beyond-the-window"])
@pytest.mark.parametrize("architecture,static_tokens", [(name, None) for name in ARCHITECTURES]
                         + [("llama", STATIC_TOKENS)], ids=[*ARCHITECTURES, "llama-static"])
def test_a_conversation_s_next_turn_gives_the_greedy_tokens_of_a_whole_prefill(tiny_model_dir, architecture,
                                                                               static_tokens, first_turn_tokens):
    # The first turn keeps the blocks of every position it ran; the second attaches them and prefills only the rest.
    # Where a sliding window already dropped positions nothing is kept and the turn prefills whole: either way, the
    # tokens are those of a session that computed everything itself.
    path = tiny_model_dir(architecture)
    head, block = load_head(path), 2
    runner = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, prefix_ttl_s=600.0, static_cache_tokens=static_tokens,
                              **RUNNER_KV_LIMITS)
    first_turn = [1, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27][:first_turn_tokens]
    answer = greedy(runner, head, "turn-1", first_turn, 3)
    ran = first_turn + answer[:-1]
    names = [f"{index:032x}" for index in range(len(ran) // block)]
    kept = runner.keep_prefix("turn-1", names, block)
    second_turn = first_turn + answer + [29, 31]
    attached = runner.attach_prefix("turn-2", names + ["f" * 32], block)
    assert attached == kept
    with_kept = greedy(runner, head, "turn-2", second_turn, 4, start=attached)
    fresh = load_layer_range(path, 0, TINY_NUM_LAYERS - 1, **RUNNER_KV_LIMITS)
    assert with_kept == greedy(fresh, head, "whole", second_turn, 4)
    # Mistral's layers, every other one of Gemma 2's, two of three of Gemma 3's and Qwen 2's upper ones slide over
    # 8 positions.
    sliding = architecture in ("mistral", "gemma2", "gemma3", "qwen2")
    assert kept == (0 if sliding and len(ran) >= TINY_SLIDING_WINDOW else len(ran) // block * block)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device here")
def test_kept_prefixes_in_graphed_static_caches_give_a_whole_prefill_s_tokens_on_cuda(tiny_model_dir):
    path = tiny_model_dir("llama")
    head = load_head(path, dtype="fp32", device="cuda")

    def graphed():
        return load_layer_range(path, 0, TINY_NUM_LAYERS - 1, dtype="fp32", device="cuda", prefix_ttl_s=600.0,
                                static_cache_tokens=STATIC_TOKENS, **RUNNER_KV_LIMITS)

    runner, block = graphed(), 4
    assert runner.graphs_decode
    first_turn = PROMPT[:10]
    answer = greedy(runner, head, "turn-1", first_turn, 6)
    ran = first_turn + answer[:-1]
    names = [f"{index:032x}" for index in range(len(ran) // block)]
    kept = runner.keep_prefix("turn-1", names, block)
    assert kept == len(ran) // block * block
    second_turn = first_turn + answer + [41, 43, 47]
    captures = runner.graph_captures_total
    assert runner.attach_prefix("turn-2", names + ["f" * 32], block) == kept
    with_kept = greedy(runner, head, "turn-2", second_turn, 8, start=kept)
    assert runner.graph_captures_total > captures  # the attached session's decode steps replay graphs of its own
    assert with_kept == greedy(graphed(), head, "whole", second_turn, 8)


def wide_bf16_model(folder):
    """A 2-layer random Llama with 64-dimension heads: in bf16 on the CPU its decode steps' KV is not a prefill's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512)).save_pretrained(folder)
    return folder


def orchestrator_of(block_tokens: int):
    """A ChainBuilder for a call of `prompt_ids` that generated `generated`, on stand-ins of what naming needs."""
    from types import SimpleNamespace

    from hearth.protocol.chat import ChatRequest
    from hearth.services.common.config import HearthSettings
    from hearth.services.orchestrator.call import Call
    from hearth.services.orchestrator.answer_kv import AnswerWarmUps
    from hearth.services.orchestrator.construct import ChainBuilder
    from hearth.services.orchestrator.prefix import KeptChains

    settings = HearthSettings()
    settings = settings.model_copy(update={"prefix_cache": settings.prefix_cache.model_copy(
        update={"block_tokens": block_tokens})})
    ctx = SimpleNamespace(settings=settings, kept_chains=KeptChains(), warm_ups=AnswerWarmUps(),
                          outbox=SimpleNamespace(signing_key=None))
    model = SimpleNamespace(model_id="wide", weights_sha256="0" * 64, head=SimpleNamespace(rope_switch_tokens=None))

    def builder(prompt_ids: list[int], generated: list[int]) -> ChainBuilder:
        call = Call(request=ChatRequest(model="wide", prompt="-", max_tokens=64), model=model, client=None,
                    prompt_ids=prompt_ids, generated=generated)
        return ChainBuilder(call, ctx)
    return builder


@pytest.mark.parametrize("seed", [2, 11])
def test_a_conversation_s_next_turn_from_what_a_call_keeps_gives_a_whole_prefill_s_greedy_tokens_in_bf16(
        tmp_path, one_torch_thread, seed):  # noqa: F811
    # A decode step's KV is not bitwise a prefill's (other kernels): kept as they were, the answer's positions gave
    # turn 2 other greedy tokens than its whole prefill in these conversations (on a 2-core AMD EPYC). What a call's
    # hops keep instead (hearth/services/orchestrator/construct.py, answer_kv.py): the prompt's blocks at its close,
    # then the answer's blocks as a warm-up prefilled them from there; turn 2 then begins past the answer and samples
    # the whole prefill's tokens.
    from hearth.services.orchestrator.router import Hop

    path, block = wide_bf16_model(tmp_path / "wide"), 16
    head = load_head(path, dtype="bf16")

    def runner(**extra):
        return load_layer_range(path, 0, 1, dtype="bf16", **RUNNER_KV_LIMITS, **extra)

    generator = torch.Generator().manual_seed(seed)
    first_turn = torch.randint(3, 128, (40,), generator=generator).tolist()
    # What kept prefixes rest on: a prefill split at a block boundary computes what the whole prefill does. Where
    # this CPU's bf16 kernels do not (their blocking follows the rows), no kept KV could give a whole prefill's tokens.
    whole, split = runner(), runner()
    at_once = whole.forward("whole", head.embed(first_turn), 0, "prefill")
    split.forward("split", head.embed(first_turn[:block]), 0, "prefill")
    if not torch.equal(at_once[:, block:], split.forward("split", head.embed(first_turn[block:]), block, "prefill")):
        pytest.skip("this CPU's bf16 prefill is not the same split at a block boundary")
    shard = runner(prefix_ttl_s=600.0)
    answer = greedy(shard, head, "turn-1", first_turn, 30)
    builder = orchestrator_of(block)(first_turn, answer)
    builder.keep_on_completion(SimpleChain([Hop("s", "c", "n", 0, 1)]))
    assert len(builder.kept.hashes) == len(first_turn) // block
    assert shard.keep_prefix("turn-1", builder.kept.hashes, block) == len(first_turn) // block * block
    # The warm-up: a fresh session from the prompt's blocks prefills the answer's whole blocks and keeps them all.
    ran = first_turn + answer[:-1]
    positions = len(builder.warm_up.hashes) * block
    assert positions == len(ran) // block * block > len(builder.kept.hashes) * block
    start = shard.attach_prefix("warm-up", builder.kept.hashes, block)
    shard.forward("warm-up", head.embed(ran[start:positions]), start, "prefill", prompt_tokens=positions)
    assert shard.keep_prefix("warm-up", builder.warm_up.hashes, block) == positions

    second_turn = first_turn + answer + torch.randint(3, 128, (10,), generator=generator).tolist()
    next_turn = orchestrator_of(block)(second_turn, [])
    names = next_turn.naming("none").reusable(second_turn).hashes
    assert names[:len(builder.warm_up.hashes)] == builder.warm_up.hashes
    attached = shard.attach_prefix("turn-2", names, block)
    assert attached == positions  # only the new tokens are computed
    whole = greedy(runner(), head, "whole", second_turn, 10)
    assert greedy(shard, head, "turn-2", second_turn, 10, start=attached) == whole


class SimpleChain:
    """What keep_on_completion reads of a chain: its hops."""

    def __init__(self, hops) -> None:
        self.hops = hops
