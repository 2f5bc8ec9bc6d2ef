"""Request/reply messages on a shard's control subject (docs/protocol.md): open, close and inspect pipeline hops.

Besides §6's `open` and `close`, a shard answers `stat` with a ShardStat: what it holds open right now.
The orchestrator uses it as a liveness probe when a step stalls (a frozen or dead shard does not answer,
so the stall is blamed on it rather than on the hop feeding it), a shard starting under an id asks it to learn
whose claim on that id ranks before its own, and tests use it to check that every session and its KV cache is
freed when a request ends.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from hearth.protocol.bounds import (
    SUBJECT_TOKEN_PATTERN, max_id_chars, max_pipeline_hops, max_reason_chars, max_shard_id_chars,
)
from hearth.protocol.mesh_protocol import MESH_PROTOCOL, max_mesh_protocol
from hearth.protocol.quantization_labels import QUANTIZATION_LABEL_PATTERN
from hearth.protocol.subjects import LOCAL_NODE

LINK_KEY_PATTERN = r"^[A-Za-z0-9_-]{43}=$"
# An open's keys sealed to its host's member key (OpenHop.sealed_keys): urlsafe base64 of a libsodium sealed box of
# hearth/services/transport/key_seal.py's HopKeys; far more than its four keys and the ids it is bound to need.
max_sealed_keys_chars = 2048
SEALED_KEYS_PATTERN = rf"^[A-Za-z0-9_-]{{1,{max_sealed_keys_chars}}}={{0,2}}$"
# A close's or keep's proof that it comes from the hop's orchestrator: HMAC-SHA256 under the owner key, hex.
OWNER_PROOF_PATTERN = r"^[0-9a-f]{64}$"
# More open pipelines than a ShardStat can list: far more than any shard's max_concurrent_streams.
max_open_pipelines = 4096
# A kept prefix's block names (hearth/services/orchestrator/prefix.py): 128-bit hex digests, as many as a session's
# positions allow blocks of the smallest size.
PREFIX_HASH_PATTERN = r"^[0-9a-f]{32}$"
# A starting shard's claim on its id (hearth/services/shard/claim.py): 128 random bits, hex.
CLAIM_NONCE_PATTERN = r"^[0-9a-f]{32}$"
# When a claim was made: Unix time in nanoseconds, as a signed 64-bit count.
max_claim_time_ns = 2**63 - 1
max_prefix_blocks = 8192
max_prefix_block_tokens = 4096
# `pipeline_taken`: the pipeline is open on this shard for another orchestrator (its ids travel in plain headers, so a
# member may have opened it first): the refused orchestrator routes around the shard without blaming it. `withdrawn`:
# the shard has said it leaves (a `hearth host` moving lets the calls open there end first) and opens nothing new; the
# orchestrator's read model had not heard it yet, and routes around it without blame.
RefusalCode = Literal["at_capacity", "weights_mismatch", "bad_range", "bad_request", "unknown_pipeline",
                      "pipeline_taken", "unauthorized", "withdrawn"]


class PrefixBlocks(BaseModel):
    """A session's whole blocks of `block_tokens` tokens, first to last, each named by a hash chained over every
    token before it and what they were run with (hearth/services/orchestrator/prefix.py); a shard never sees the
    tokens."""

    model_config = ConfigDict(extra="forbid")

    block_tokens: int = Field(ge=1, le=max_prefix_block_tokens)
    hashes: list[Annotated[str, Field(pattern=PREFIX_HASH_PATTERN)]] = Field(max_length=max_prefix_blocks)


class OpenHop(BaseModel):
    """Ask a shard to serve hop `hop` of a pipeline: run layers lo..hi of one session's steps."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["open"] = "open"
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    # Bounded: the shard's subjects carry the hop's number (a huge one would cost it its broker connection).
    hop: int = Field(ge=0, lt=max_pipeline_hops)
    hop_count: int = Field(ge=1, le=max_pipeline_hops)
    model_id: str = Field(max_length=max_id_chars)
    weights_sha256: str = Field(max_length=max_id_chars)
    # The scheme the chain was planned on: a shard serving another one refuses (weights_mismatch), as one restarted
    # under the same id in another scheme would otherwise join a chain on its old advert. None: not checked.
    quantization: str | None = Field(default=None, pattern=QUANTIZATION_LABEL_PATTERN)
    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0)
    # Wire dtype for this hop's output: "auto" keeps the compute dtype (lossless).
    wire_dtype: Literal["auto", "fp16", "fp32", "int8"] = "auto"
    max_session_tokens: int = Field(default=8192, ge=1)
    # The nodes this hop receives from and sends to (the previous and next hop's hosts, or the orchestrator at
    # either end): activation and ack subjects carry the node they are addressed to (hearth/protocol/subjects.py).
    upstream_node: str = Field(default=LOCAL_NODE, pattern=SUBJECT_TOKEN_PATTERN)
    downstream_node: str = Field(default=LOCAL_NODE, pattern=SUBJECT_TOKEN_PATTERN)
    # Fresh keys (urlsafe base64 of 32 bytes) for the MACs on this hop's inbound and outbound links, told to their two
    # ends alone (on a community mesh sealed, `sealed_keys`), so no other member can forge or alter its activations.
    inbound_link_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    outbound_link_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    # A fresh key for the MAC on this hop's HopNotices, told to this hop alone (a link key is shared with the hop
    # before or after, which could then speak for this hop): a notice can only speak about its sender's own hop.
    notice_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    # A secret of the pipeline's orchestrator for this shard, the same for every chain of the pipeline (a re-open too):
    # a `close`, `keep` or re-open of an open hop counts only with it, so no other member ends or copies this hop.
    owner_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    # On a community mesh the four keys above travel here instead, sealed to the host member's key (only its seed
    # opens them): the broker's machine and every subscriber to `>` would otherwise read them in clear and could
    # open sealed frames, forge notices and end other members' hops (hearth/services/transport/key_seal.py).
    sealed_keys: str | None = Field(default=None, pattern=SEALED_KEYS_PATTERN)
    # Whether this hop's inbound and outbound links are sealed (frames encrypted end to end with keys derived from
    # the link keys, hearth/services/transport/seal.py) or MAC-only. Both ends of every link learn it from their `open`,
    # so they agree; a host that does not know this field refuses the open rather than read ciphertext as a tensor.
    seal_activations: bool = False
    # The call's leading blocks an ended session of this shard may have kept (hearth/inference/prefix_cache.py): the hop
    # starts on the longest run it keeps and answers how many positions that is (`cached_tokens`); its first step,
    # a prefill or a replay, may start anywhere up to them (where every hop of the chain holds them).
    prefix: PrefixBlocks | None = None
    # The mesh protocol the orchestrator speaks (hearth/protocol/mesh_protocol.py): this hearth's in an open it makes,
    # absent from one of a hearth from before protocol versions (`told_protocol`), which a shard of another version
    # refuses as bad_request (a code every version reads), saying why.
    protocol: int = Field(default=MESH_PROTOCOL, ge=1, le=max_mesh_protocol)

    @model_validator(mode="after")
    def _ordered(self) -> "OpenHop":
        if self.layer_hi < self.layer_lo:
            raise ValueError("layer_hi must be >= layer_lo")
        if self.hop >= self.hop_count:
            raise ValueError("hop must be < hop_count")
        if self.sealed_keys is not None and any(self.plain_keys()):
            raise ValueError("an open carries its keys either sealed (sealed_keys) or in clear, not both")
        if (self.seal_activations and self.sealed_keys is None
                and (self.inbound_link_key is None or self.outbound_link_key is None)):
            raise ValueError("seal_activations needs inbound_link_key and outbound_link_key (seal keys come from them)")
        return self

    def told_protocol(self) -> int | None:
        """The mesh protocol this open says it speaks; None when it does not say (read from an older hearth's)."""
        return self.protocol if "protocol" in self.model_fields_set else None

    def plain_keys(self) -> tuple[str | None, ...]:
        """The keys this open carries in clear (what `sealed_keys` seals instead)."""
        return self.inbound_link_key, self.outbound_link_key, self.notice_key, self.owner_key


class CloseHop(BaseModel):
    """Close a pipeline's hop and free its session's cache; with `session_id`, only if that session is the
    open one (so a late close of a session that a failover already replaced never closes its successor)."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["close"] = "close"
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str | None = Field(default=None, pattern=SUBJECT_TOKEN_PATTERN)
    # The open's owner key (OpenHop.owner_key), sent by orchestrators from before `owner_proof`.
    owner_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)
    # What orchestrators send instead, never revealing the key (hearth/services/transport/key_seal.py): a MAC under
    # it over this request, session id included, so it counts for this session's hop alone.
    owner_proof: str | None = Field(default=None, pattern=OWNER_PROOF_PATTERN)
    # The session's blocks to keep for later calls beginning the same way (a call that ended well); the shard
    # keeps those it holds whole, within its KV budget, and frees the rest.
    keep: PrefixBlocks | None = None


class KeepHop(BaseModel):
    """Keep a copy of an open session's KV for the whole blocks of `keep` it holds, as `close` would, while the
    session goes on (a request's other choices begin from its prompt's blocks); answered with `cached_tokens`."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["keep"] = "keep"
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    owner_key: str | None = Field(default=None, pattern=LINK_KEY_PATTERN)  # as CloseHop's
    owner_proof: str | None = Field(default=None, pattern=OWNER_PROOF_PATTERN)  # as CloseHop's
    keep: PrefixBlocks


class ClaimRank(BaseModel):
    """A shard process's claim on its id and when it made it: of processes under one id, the earliest claim (then the
    lowest nonce) keeps it (hearth/services/shard/claim.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at_ns: int = Field(ge=0, le=max_claim_time_ns)
    nonce: str = Field(pattern=CLAIM_NONCE_PATTERN)

    def before(self, other: ClaimRank) -> bool:
        """Whether this claim outranks `other`: made earlier, or at the same time with a lower nonce."""
        return (self.at_ns, self.nonce) < (other.at_ns, other.nonce)


class StatShard(BaseModel):
    """Ask a shard what it holds open; answered with a ShardStat. A shard starting under the same id sends its
    `claim` and when it made it (hearth/services/shard/claim.py): who else answers has a claim on that id that ranks
    first."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["stat"] = "stat"
    claim: str | None = Field(default=None, pattern=CLAIM_NONCE_PATTERN)
    claimed_at_ns: int | None = Field(default=None, ge=0, le=max_claim_time_ns)  # when; None from shards before it


ControlRequest = Annotated[Union[OpenHop, CloseHop, KeepHop, StatShard], Field(discriminator="op")]
control_request_adapter: TypeAdapter[ControlRequest] = TypeAdapter(ControlRequest)


class ControlReply(BaseModel):
    ok: bool
    code: RefusalCode | None = None
    message: str = Field(default="", max_length=max_reason_chars)
    shard_id: str = Field(default="", max_length=max_shard_id_chars)
    # An opened hop's session positions taken from a kept prefix (OpenHop.prefix), or those `keep` kept.
    cached_tokens: int = Field(default=0, ge=0)
    # An opened hop takes `replay` steps (Hearth-Kind); shards from before them leave it out, and a re-prefill then
    # sends them the tokens decoded so far as prefill chunks.
    replay_steps: bool = False


class ShardStat(BaseModel):
    """A shard's answer to `stat`: its open hops and the sessions its runner still caches."""

    shard_id: str = Field(max_length=max_shard_id_chars)
    active_streams: int = Field(ge=0)
    open_pipelines: list[Annotated[str, Field(max_length=128)]] = Field(default_factory=list,
                                                                          max_length=max_open_pipelines)
    cached_sessions: int = Field(ge=0)
    cache_bytes: int = Field(ge=0)
    # Answering another process's claim (hearth/services/shard/claim.py): the answering process's own claim and when
    # it made it (`claimed`). Only shards from before `claimed` send `claim`: their own claim while still deciding.
    claim: str | None = Field(default=None, pattern=CLAIM_NONCE_PATTERN)
    claimed: ClaimRank | None = None


HopProblem = Literal["input_failed_check", "step_failed", "session_evicted"]


class HopNotice(BaseModel):
    """A hop could not pass a step on: its input failed a check (the hop before it, or the orchestrator for
    hop 0, produced it), its own computation raised (this hop is at fault), or its session's KV cache was evicted
    (`session_evicted`: nobody is at fault; the orchestrator re-prefills).

    On the wire it carries `Hearth-Mac` keyed with the hop's `notice_key` (hearth/services/transport/notices.py): its
    orchestrator reads a notice only from the hop it names."""

    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    hop: int = Field(ge=0, lt=max_pipeline_hops)
    step: int = Field(ge=0)
    problem: HopProblem
    check: Literal["nan", "inf", "norm", "shape"] | None = None
    # The exception's type and first line; never tensor contents.
    message: str = Field(default="", max_length=500)

    @model_validator(mode="after")
    def _check_named_when_input_failed(self) -> "HopNotice":
        if (self.problem == "input_failed_check") != (self.check is not None):
            raise ValueError("check is given exactly when the problem is input_failed_check")
        return self


def read_reply(data: bytes) -> ControlReply:
    """A shard's answer to a control request: an answer that is no ControlReply reads as a refusal saying so, in one
    line (a malformed answer of one hop must not end the call that asked, nor bring the shard's text with it)."""
    try:
        return ControlReply.model_validate_json(data)
    except ValueError:
        return ControlReply(ok=False, message="the shard's answer is no ControlReply")


def reply_says_ok(data: bytes) -> bool:
    """Whether a shard's answer is a ControlReply saying `ok`."""
    return read_reply(data).ok
