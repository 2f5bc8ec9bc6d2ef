"""Kept prefixes in the event log and the read model: a completed call's kept blocks become a kept_prefixes row (named
by the last block, pruned once expired), the query finds the chain holding the most leading names of a call, and a
second orchestrator that remembers nothing routes a conversation's next turn to the chain the read model names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy.orm import Session, sessionmaker

from hearth.events.models import (
    KeptHop,
    KeptMark,
    KeptPrefix,
    PipelineCompleted,
    encode_event,
    max_kept_marks,
)
from hearth.events.signing import sign_event
from hearth.events.envelope import max_event_duration_s, max_event_number
from hearth.events.streams import event_max_msg_bytes
from hearth.protocol.bounds import max_shard_id_chars
from hearth.readmodels.queries import kept_chain_holding
from hearth.readmodels.tables import KeptPrefixRecord
from hearth.services.common.config import HearthSettings
from hearth.services.common.config_processes import PrefixCacheSettings
from hearth.services.orchestrator.construct import ChainBuilder
from hearth.services.orchestrator.answer_kv import AnswerWarmUps
from hearth.protocol.control import PrefixBlocks
from hearth.services.orchestrator.prefix import (
    KeptChains,
    behind_hops,
    block_names,
    caller_scope,
    first_name,
    kept_marks,
    published_mark,
)
from hearth.services.orchestrator.router import Hop, ShardRouter
from hearth.trust.keys import MemberKey
from tests.readmodel_helpers import (
    MODEL_INFO,
    MODEL_ID,
    WEIGHTS_SHA,
    LogBuilder,
    advertised,
    apply_all,
    at,
    dump_rows,
    heartbeat,
    migrated_engine,
)

NAMES = block_names(list(range(40)), 4, first_name("m", "w", "none", "auto", 4), "unsigned")  # ten names
CHAIN_A = [KeptHop(shard_id="m:0-3@a", layer_lo=0, layer_hi=3), KeptHop(shard_id="m:4-7@b", layer_lo=4, layer_hi=7)]


@pytest.fixture
def engine(tmp_path):
    engine = migrated_engine(tmp_path / "rm.db")
    yield engine
    engine.dispose()

def completed(pipeline_id: str, kept: KeptPrefix | None, *, t: float = 5.0) -> PipelineCompleted:
    return PipelineCompleted(pipeline_id=pipeline_id, prompt_tokens=30, completion_tokens=6, duration_ms=40.0,
                             tokens_per_second=50.0, finish_reason="length", node_id="hub", occurred_at=at(t),
                             kept_prefix=kept)


def kept(names: list[str], hops=CHAIN_A, idle_s: float = 600.0) -> KeptPrefix:
    """What a call that kept `names` records when only its last block is marked."""
    return KeptPrefix(hops=hops, marks=[KeptMark(blocks=len(names), name=names[-1])], idle_s=idle_s)


def holding(engine, names, now_s):
    """The chain the read model names for an orchestrator of an open mesh (unsigned records)."""
    with Session(engine) as session:
        return kept_chain_holding(session, names, now_s, None)


def test_a_completed_call_s_marked_blocks_become_rows_named_by_them(engine):
    log = LogBuilder()
    marked = KeptPrefix(hops=CHAIN_A, marks=[KeptMark(blocks=2, name=NAMES[1]), KeptMark(blocks=6, name=NAMES[5])],
                        idle_s=600)
    apply_all(engine, [log.stored(completed("p1", marked, t=5.5)), log.stored(completed("p2", None))])
    hops, kept_at = '[["m:0-3@a", 0, 3], ["m:4-7@b", 4, 7]]', int(at(5.5).timestamp())
    assert sorted(dump_rows(engine)["kept_prefixes"], key=lambda row: row[4]) == [
        ("", NAMES[1], "p1", hops, 2, kept_at, kept_at + 600), ("", NAMES[5], "p1", hops, 6, kept_at, kept_at + 600)]


def test_a_call_marks_its_last_block_the_last_two_of_its_prompt_and_powers_of_two():
    names = [f"{index:032x}" for index in range(1, 41)]
    marked = kept_marks(names, prompt_blocks=37, keeper=None)
    assert [blocks for blocks, _ in marked] == [1, 2, 4, 8, 16, 32, 36, 37, 40]
    assert marked[-1] == (40, published_mark(names[39], None))
    assert kept_marks(names[:1], prompt_blocks=1, keeper=None) == [(1, published_mark(names[0], None))]
    # What the log records finds a chain but never opens KV: no mark is a block name.
    assert not {mark for _, mark in marked} & set(names)
    # On a community mesh a mark is its member's: another member's hops could not attach the blocks it finds.
    member, other = MemberKey.generate(), MemberKey.generate()
    assert len({published_mark(names[0], keeper) for keeper in (None, member, other)}) == 3
    # The most blocks a call may name still fit an event.
    assert len(kept_marks([f"{i:032x}" for i in range(8192)], prompt_blocks=8000, keeper=None)) <= max_kept_marks


def test_the_chain_holding_the_most_leading_names_is_found(engine):
    log = LogBuilder()
    chain_b = [KeptHop(shard_id="m:0-7@c", layer_lo=0, layer_hi=7)]
    apply_all(engine, [log.stored(completed("p1", kept(NAMES[:2]))),
                       log.stored(completed("p2", kept(NAMES[:8], hops=chain_b)))])
    now_s = at(10).timestamp()
    assert holding(engine, NAMES, now_s).hops == (("m:0-7@c", 0, 7),)
    assert holding(engine, NAMES, now_s).blocks == 8
    # A call sharing only the first three blocks: the chain that kept two of them (the other's last name is not its).
    found = holding(engine, NAMES[:3], now_s)
    assert (found.hops, found.blocks) == ((("m:0-3@a", 0, 3), ("m:4-7@b", 4, 7)), 2)
    edited = block_names([1, *range(1, 40)], 4, first_name("m", "w", "none", "auto", 4), "unsigned")
    assert holding(engine, edited, now_s) is None
    assert holding(engine, NAMES, at(5).timestamp() + 601) is None  # the hops dropped them by then


def test_a_long_call_s_names_are_looked_up_in_parts_longest_first(engine):
    names = block_names(list(range(1200)), 1, first_name("m", "w", "none", "auto", 1), "unsigned")
    log = LogBuilder()
    apply_all(engine, [log.stored(completed("p1", kept(names[:101]))),
                       log.stored(completed("p2", kept(names[:701], hops=CHAIN_A[:1])))])
    assert holding(engine, names, at(6).timestamp()).blocks == 701
    assert holding(engine, names[:650], at(6).timestamp()).blocks == 101


@pytest.mark.parametrize("records, left", [
    # (blocks kept, idle_s, t) in log order; the one name left. Three in time order: the later prunes the earlier.
    ([(3, 60, 0), (5, 60, 30), (9, 60, 100)], NAMES[8]),
    # Another orchestrator's record of t=100 (expiring at 400) reaches the log after one of t=2000.
    ([(3, 300, 2000), (5, 300, 100)], NAMES[2]),
])
def test_records_expired_before_the_latest_one_kept_are_pruned_whatever_the_batching(tmp_path, records, left):
    log = LogBuilder()
    messages = [log.stored(completed(f"p{index}", kept(NAMES[:blocks], idle_s=idle_s), t=t))
                for index, (blocks, idle_s, t) in enumerate(records)]
    together, apart = migrated_engine(tmp_path / "one.db"), migrated_engine(tmp_path / "apart.db")
    apply_all(together, messages)
    for message in messages:
        apply_all(apart, [message])
    assert dump_rows(together) == dump_rows(apart)
    assert [row[1] for row in dump_rows(apart)["kept_prefixes"]] == [left]
    together.dispose()
    apart.dispose()


def test_a_record_dated_before_one_of_the_same_name_leaves_the_same_rows_whatever_the_batching(tmp_path):
    # Two orchestrators of one member with clocks apart (or a clock stepped back): the name X kept at 100 is kept
    # again by a record dated 40 that the log stores after it, and keeps its blocks longer.
    chain_b, chain_c = ([KeptHop(shard_id=f"m:0-7@{node}", layer_lo=0, layer_hi=7)] for node in "bc")
    log = LogBuilder()
    messages = [log.stored(completed("p-y", kept(NAMES[:2], idle_s=10), t=50)),
                log.stored(completed("p-x", kept(NAMES[:4], hops=chain_b, idle_s=10), t=100)),
                log.stored(completed("p-x-again", kept(NAMES[:4], hops=chain_c, idle_s=200), t=40))]
    together, apart = migrated_engine(tmp_path / "one.db"), migrated_engine(tmp_path / "apart.db")
    apply_all(together, messages)
    for message in messages:
        apply_all(apart, [message])
    assert dump_rows(together) == dump_rows(apart)
    # Y expired before X was kept at 100; both records of X stay, each its own row.
    assert sorted((row[1], row[2]) for row in dump_rows(apart)["kept_prefixes"]) == [
        (NAMES[3], "p-x"), (NAMES[3], "p-x-again")]
    # The newest record of a name not expired names the chain: X's of 100 until it expires, then X's of 40.
    assert holding(apart, NAMES, at(105).timestamp()).hops == (("m:0-7@b", 0, 7),)
    assert holding(apart, NAMES, at(200).timestamp()).hops == (("m:0-7@c", 0, 7),)
    assert holding(apart, NAMES[:2], at(60).timestamp()) is None
    together.dispose()
    apart.dispose()


def test_the_same_blocks_kept_again_name_the_later_chain(engine):
    log = LogBuilder()
    chain_b = [KeptHop(shard_id="m:0-7@c", layer_lo=0, layer_hi=7)]
    apply_all(engine, [log.stored(completed("p1", kept(NAMES[:4]), t=1)),
                       log.stored(completed("p2", kept(NAMES[:4], hops=chain_b), t=2))])
    assert holding(engine, NAMES[:4], at(3).timestamp()).hops == (("m:0-7@c", 0, 7),)
    # Each record is its own row: the earlier stays until its signer keeps one after it expired.
    with Session(engine) as session:
        assert [record.pipeline_id for record in session.query(KeptPrefixRecord).order_by(KeptPrefixRecord.kept_at)
                ] == ["p1", "p2"]


def test_the_largest_completed_event_with_a_kept_prefix_fits_the_streams():
    worst = "\x00" * max_shard_id_chars
    widest = max_event_number  # the widest number an event may carry; the idle time the widest duration below it
    event = completed("p" * 128, KeptPrefix(hops=[KeptHop(shard_id=worst, layer_lo=widest, layer_hi=widest)] * 64,
                                            marks=[KeptMark(blocks=widest, name="f" * 32)] * max_kept_marks,
                                            idle_s=max_event_duration_s - 2**-29))
    assert len(encode_event(event)) < event_max_msg_bytes - 4096
    with pytest.raises(ValueError):
        KeptMark(blocks=1, name="not a block name")


# ------------------------------------------------------------------ routing across orchestrators

PROMPT = list(range(100, 141))  # 41 tokens: ten whole blocks of 4 before the last


def orchestrator_context(engine, settings: HearthSettings, signing_key: MemberKey | None = None) -> SimpleNamespace:
    """What ChainBuilder reads of an orchestrator (of `signing_key`'s member; None: on an open mesh) that has just
    started: a read model, no memory of kept chains."""
    sessions = sessionmaker(engine)
    router = ShardRouter(sessions, health_timeout_s=60, allow_self_as_shard=True, self_node_id="orch",
                         clock=lambda: at(20).timestamp())
    return SimpleNamespace(settings=settings, router=router, projector=SimpleNamespace(session_factory=sessions),
                           kept_chains=KeptChains(), quarantined=set(), warm_ups=AnswerWarmUps(),
                           recent_failures=SimpleNamespace(current=lambda: set()),
                           outbox=SimpleNamespace(signing_key=signing_key))


def call_of(prompt: list[int], generated: list[int] = ()) -> SimpleNamespace:
    """A call of `prompt` that has fed `generated` back (all of them: the positions its hops ran)."""
    known = [*prompt, *generated]
    return SimpleNamespace(model=SimpleNamespace(model_id=MODEL_ID, weights_sha256=WEIGHTS_SHA,
                                                 head=SimpleNamespace(rope_switch_tokens=None, info=MODEL_INFO)),
                           caller=None,
                           request=SimpleNamespace(params=SimpleNamespace(verify="sampled"), max_tokens=4,
                                                   most_tokens=4),
                           known_ids=known, next_position=len(known), prompt_ids=list(prompt),
                           quantization=None, excluded={})


async def planned(engine, settings, prompt, signing_key: MemberKey | None = None) -> list[str]:
    builder = ChainBuilder(call_of(prompt), orchestrator_context(engine, settings, signing_key))
    candidates = builder.ctx.router.candidates(MODEL_ID)
    builder.recorded_kept = await builder._recorded_kept(builder._reusable_by_scheme(candidates))
    return [hop.shard_id for hop in builder._plan(candidates, load=None)]


def completed_call_on(shard_id: str, settings: HearthSettings, signing_key: MemberKey | None = None) -> KeptPrefix:
    """What a first turn's call (30 prompt tokens, 3 fed back) through an orchestrator of `signing_key`'s member
    records once it ran on `shard_id` and ended well."""
    first = ChainBuilder(call_of(PROMPT[:30], [999, 998, 997]),
                         SimpleNamespace(settings=settings, kept_chains=KeptChains(), warm_ups=AnswerWarmUps(),
                                         outbox=SimpleNamespace(signing_key=signing_key)))
    return first.keep_on_completion(SimpleNamespace(hops=[Hop(shard_id=shard_id, control_subject="c", node_id="far",
                                                              layer_lo_to_run=0, layer_hi_to_run=7)]))


async def test_a_fresh_orchestrator_routes_to_the_chain_another_one_s_call_kept(engine):
    settings = HearthSettings(prefix_cache=PrefixCacheSettings(enabled=True, block_tokens=4))
    log = LogBuilder()
    # Two replicas of the whole model; the host of `far` asks to be used last, so cost alone picks `near`.
    far, near = advertised(0, 7, "far", hop_weight=1.5), advertised(0, 7, "near")
    apply_all(engine, [log.stored(far), log.stored(near), log.stored(heartbeat(far.shard_id, decode_step_ms=5.0)),
                       log.stored(heartbeat(near.shard_id, decode_step_ms=5.0))])
    assert await planned(engine, settings, PROMPT) == [near.shard_id]
    # The first orchestrator's call (30 prompt tokens, 3 fed back) ran on `far` and ended well: its completion names
    # what `far` keeps. The next turn's history renders the answer as other tokens: its blocks agree up to the last
    # whole block of that prompt.
    record = completed_call_on(far.shard_id, settings)
    assert record.marks[-1].blocks == 8 and record.hops == [KeptHop(shard_id=far.shard_id, layer_lo=0, layer_hi=7)]
    apply_all(engine, [log.stored(completed("p1", record, t=10))])
    # The next turn (the same tokens and more) through an orchestrator that remembers nothing: to `far`.
    assert await planned(engine, settings, PROMPT) == [far.shard_id]
    # A call that shares no block with it still goes by cost.
    assert await planned(engine, settings, [7, *PROMPT[1:]]) == [near.shard_id]


async def test_on_a_community_mesh_only_its_own_member_s_kept_chains_draw_an_orchestrator(engine):
    # A shard lets only hops its own member opened attach what a member's hops kept: a chain another member's call
    # kept would cost a whole prefill anyway, so routing must not prefer it over the cheapest.
    settings = HearthSettings(prefix_cache=PrefixCacheSettings(enabled=True, block_tokens=4))
    keeper, other = MemberKey.generate(), MemberKey.generate()
    log = LogBuilder()
    far, near = advertised(0, 7, "far", hop_weight=1.5), advertised(0, 7, "near")
    apply_all(engine, [log.stored(far), log.stored(near), log.stored(heartbeat(far.shard_id, decode_step_ms=5.0)),
                       log.stored(heartbeat(near.shard_id, decode_step_ms=5.0))])
    record = completed("p1", completed_call_on(far.shard_id, settings, keeper), t=10)
    apply_all(engine, [log.stored(sign_event(record, keeper))])
    assert await planned(engine, settings, PROMPT, keeper) == [far.shard_id]  # another orchestrator of its member
    assert await planned(engine, settings, PROMPT, other) == [near.shard_id]
    assert await planned(engine, settings, PROMPT) == [near.shard_id]  # nor an orchestrator of an open mesh


def test_a_member_reading_the_log_cannot_test_a_guess_of_another_member_s_conversation():
    # Everything a block's name is drawn over but the tokens is known to every member (the model, its weights and
    # scheme, the caller's roster name, the keeper's public key): were a mark a digest of public things, anyone
    # reading `pipeline.completed` could confirm a guessed conversation ("did member x ask about ...?") by computing
    # its marks. A mark is keyed by a secret of the keeper's member: its orchestrators share it, no other member has it.
    import hashlib

    keeper = MemberKey.generate()
    settings = HearthSettings(prefix_cache=PrefixCacheSettings(enabled=True, block_tokens=4))
    recorded = {mark.name for mark in completed_call_on("far", settings, keeper).marks}
    # The names themselves are keyed by the keeper (test below): grant the guesser even those.
    first = first_name(MODEL_ID, WEIGHTS_SHA, "none", settings.research.distributed_inference.activation_dtype, 4,
                       keeper=keeper)
    guessed = block_names([*PROMPT[:30], 999, 998, 997], 4, first, "unsigned")

    def from_public_things(name: str) -> str:
        message = b"hearth-kept-mark-of\0" + keeper.public_key.encode() + b"\0" + bytes.fromhex(name)
        return hashlib.blake2b(message, digest_size=16).hexdigest()

    assert recorded  # the guess is right: these are the call's names
    assert not recorded & {from_public_things(name) for name in guessed}
    assert not recorded & {published_mark(name, MemberKey.generate()) for name in guessed}
    # Another orchestrator of the same member (the same key) draws the same marks.
    assert recorded <= {published_mark(name, MemberKey.from_seed(keeper.seed)) for name in guessed}


def test_a_later_hop_s_host_cannot_test_a_guess_of_a_conversation_against_the_names_it_keeps():
    # A later hop sees a call's block names but not its tokens (the first hop sees the embeddings anyway). Were the
    # names drawn over public things only (model, weights, scheme, the caller's roster name, the hops before it), its
    # host could confirm a guessed conversation by computing them. They chain onto a first name keyed by a secret of
    # the calling orchestrators' member: another orchestrator of that member draws the same, nobody else can.
    settings = HearthSettings(prefix_cache=PrefixCacheSettings(enabled=True, block_tokens=4))
    keeper = MemberKey.generate()
    hops = [Hop(shard_id=f"m:{lo}-{lo + 3}@{node}", control_subject="c", node_id=node, layer_lo_to_run=lo,
                layer_hi_to_run=lo + 3) for lo, node in ((0, "a"), (4, "b"))]
    ran = [*PROMPT[:30], 999, 998, 997]

    def second_hop_names(key: MemberKey | None) -> list[str]:
        context = SimpleNamespace(settings=settings, kept_chains=KeptChains(), warm_ups=AnswerWarmUps(),
                                  outbox=SimpleNamespace(signing_key=key))
        naming = ChainBuilder(call_of(PROMPT[:30], ran[30:]), context).naming("none")
        return behind_hops(naming.kept(ran), hops, 1).hashes

    seen = second_hop_names(keeper)
    wire_dtype = settings.research.distributed_inference.activation_dtype
    public_first = first_name(MODEL_ID, WEIGHTS_SHA, "none", wire_dtype, 4)
    guessed = PrefixBlocks(block_tokens=4, hashes=block_names(ran, 4, public_first, caller_scope(None)))
    assert len(seen) == 8 and not set(seen) & set(behind_hops(guessed, hops, 1).hashes)
    assert not set(seen) & set(second_hop_names(MemberKey.generate()))
    assert second_hop_names(MemberKey.from_seed(keeper.seed)) == seen
    # On an open mesh (no members) the names are the public ones.
    assert second_hop_names(None) == behind_hops(guessed, hops, 1).hashes
