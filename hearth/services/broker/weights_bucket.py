"""The community's weights bucket as a stream of the broker's store: its bound (`max_bytes`, which the server reserves
beside the event streams' own, so checkpoints never take the room the event log keeps), brought to that bound by the
steward's tooling, and the room it has left.

The server refuses to reserve more than its store holds (`max_file_store`, hearth/services/broker/store_space.py)
with the other streams' reservations counted, and refuses a write into a bucket at its bound ("maximum bytes
exceeded"): the bucket discards new writes, never stored ones, so a bound lowered below what it holds removes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from hearth.events.cancellation import keeping_cancellation
from hearth.events.streams import NO_ROOM_IN_STORE_ERR_CODE, MiB, consumer_limits, max_consumers_per_stream, \
    weights_consumer_inactive_limit_s
from hearth.services.broker.permissions import WEIGHTS_BUCKET, WEIGHTS_STREAM
from hearth.services.broker.store_space import streams_reserve_bytes
from hearth.services.common.config import WeightsSettings

# JetStream's answers to a write the bucket's bound ("maximum bytes exceeded") or the whole store ("insufficient
# resources") has no room for.
STORE_FULL_ERR_CODES = (10077, 10023)
WHERE_THE_BOUND_COMES_FROM = ("`hearth nats --community` bounds it when it starts; for a broker started otherwise set "
                              "[weights] max_store_mb")


class WeightsBucketError(Exception):
    """The weights bucket cannot be written within a bound: there is none, or the store cannot reserve the one asked
    for; the message is one line naming what and why."""


@dataclass(frozen=True)
class BucketRoom:
    """The bucket's bound (its max_bytes; None: none) and what it holds, by the server's count."""

    bound: int | None
    held: int

    @property
    def free(self) -> int:
        return 0 if self.bound is None else max(0, self.bound - self.held)


def shown_size(size: int) -> str:
    """`size` bytes as the weights store's lines show it (in MiB, as `hearth weights list` always has)."""
    return f"{size / MiB:.1f} MB"


def weights_bucket_bound_bytes(weights: WeightsSettings, store_bound: int | None = None) -> int | None:
    """The bucket's max_bytes: [weights] max_store_mb when set, else its store_share of the room a store bounded at
    `store_bound` bytes (None: one hearth did not bound) has beyond the streams' reservation; None when neither
    gives one."""
    if weights.max_store_mb is not None:
        return int(weights.max_store_mb * MiB)
    if store_bound is None or store_bound <= streams_reserve_bytes():
        return None
    return int((store_bound - streams_reserve_bytes()) * weights.store_share)


async def bucket_room(js) -> BucketRoom | None:
    """What the bucket may hold and holds now (None: the broker has no bucket)."""
    try:
        info = await keeping_cancellation(js.stream_info(WEIGHTS_STREAM))
    except NotFoundError:
        return None
    bound = info.config.max_bytes
    return BucketRoom(bound=bound if bound is not None and bound > 0 else None, held=info.state.bytes or 0)


def _bounded(config: StreamConfig, max_bytes: int) -> StreamConfig:
    # Discard new: a bucket at its bound refuses the next write instead of dropping a stored object's chunks.
    return config.evolve(max_bytes=max_bytes, discard=DiscardPolicy.NEW, max_consumers=max_consumers_per_stream,
                         consumer_limits=consumer_limits(weights_consumer_inactive_limit_s))


def _new_bucket_config(max_bytes: int) -> StreamConfig:
    """The stream nats-py's create_object_store makes (ADR-20's layout), bounded."""
    return _bounded(StreamConfig(
        name=WEIGHTS_STREAM, description="hearth: checkpoints stored per layer (hearth weights publish)",
        subjects=[f"$O.{WEIGHTS_BUCKET}.C.>", f"$O.{WEIGHTS_BUCKET}.M.>"], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, num_replicas=1, allow_rollup_hdrs=True, allow_direct=True), max_bytes)


async def ensure_weights_bucket(js, max_bytes: int | None) -> BucketRoom:
    """Create the bucket bounded to `max_bytes`, or bring the existing one to it (its other settings kept); None
    keeps the bound it has. Its readers' consumers are held to the event streams' limits either way. The steward's
    alone (stream administration); WeightsBucketError when the store cannot reserve the bound, or there is none."""
    try:
        info = await keeping_cancellation(js.stream_info(WEIGHTS_STREAM))
    except NotFoundError:
        info = None
    existing = info.config if info is not None else None
    if max_bytes is None:
        if existing is None or existing.max_bytes is None or existing.max_bytes <= 0:
            raise WeightsBucketError(f"the broker's weights bucket {'has no bound' if existing else 'does not exist'}"
                                     f": {WHERE_THE_BOUND_COMES_FROM}, so that checkpoints never take the room its "
                                     "event streams keep")
        max_bytes = existing.max_bytes
    try:
        if existing is None:
            await keeping_cancellation(js.add_stream(_new_bucket_config(max_bytes)))
        elif (wanted := _bounded(existing, max_bytes)) != existing:
            await keeping_cancellation(js.update_stream(wanted))
    except APIError as error:
        if error.err_code == NO_ROOM_IN_STORE_ERR_CODE:
            raise WeightsBucketError(
                f"the broker's store cannot reserve {shown_size(max_bytes)} for the weights bucket beside what its "
                "other streams reserve: lower [weights] max_store_mb, or free space on the broker's disk and restart "
                "it") from None
        raise
    return BucketRoom(bound=max_bytes, held=(info.state.bytes or 0) if info is not None else 0)
