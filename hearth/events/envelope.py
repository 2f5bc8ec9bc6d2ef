"""The fields every event carries (`EventEnvelope`) and the bounds on every value an event holds (docs/events.md,
"The envelope" and "Limits"); the event types themselves are in hearth/events/models.py."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hearth.protocol.bounds import max_id_chars, max_label_chars, max_pipeline_hops, max_shard_id_chars
from hearth.trust.keys import PUBLIC_KEY_PATTERN, USER_PUBLIC_KEY_LENGTH

# Every string and list an event carries is bounded (docs/events.md, "Limits"), so no event, forged or buggy, can
# fill the log or a read model: the largest event fits the streams' max_msg_size (hearth/events/streams.py).
max_event_hops = max_pipeline_hops  # hops of a pipeline (hearth/protocol/bounds.py)
max_signature_chars = 128  # an Ed25519 signature is 88 base64 characters; a longer one is refused
# The largest magnitude of any number an event carries: no honest one comes near it, and the read models' 64-bit
# columns hold it (sums over many events saturate: hearth/readmodels/batch_rows.py, saturating_add).
max_event_number = 2**40
# The longest duration an event states (an advertisement's TTL, how long kept blocks stay): expiry times computed
# from it stay within any calendar.
max_event_duration_s = 10**7


Id = Annotated[str, Field(max_length=max_id_chars)]
ShardId = Annotated[str, Field(max_length=max_shard_id_chars)]
Label = Annotated[str, Field(max_length=max_label_chars)]
Hops = Annotated[list[ShardId], Field(max_length=max_event_hops)]


def new_event_id() -> str:
    return uuid.uuid4().hex


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class BoundedNumbers(BaseModel):
    """A part of an event whose numbers are finite and within max_event_number: an event a member could make the read
    models fail on (a poison message stalling every projector) is undecodable instead, skipped alike everywhere."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="after")
    def _numbers_within_bounds(self):
        for name, value in self:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > max_event_number:
                raise ValueError(f"{name} is beyond {max_event_number} in magnitude")
        return self


class EventEnvelope(BoundedNumbers):
    """Fields every event carries; `event_id` doubles as the Nats-Msg-Id header for de-duplication."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=64)
    version: int = 1
    occurred_at: datetime = Field(default_factory=utc_now)
    node_id: str = Field(min_length=1, max_length=max_id_chars)
    # Who vouches for the event (hearth/events/signing.py): the emitting member's nkey and its Ed25519 signature
    # (base64) over the event's canonical bytes. Absent on an open (--insecure) mesh; a community's
    # projectors apply only events signed by a member whose role may emit them (docs/events.md, "Signatures").
    signer: str | None = Field(default=None, max_length=USER_PUBLIC_KEY_LENGTH, pattern=PUBLIC_KEY_PATTERN)
    signature: str | None = Field(default=None, max_length=max_signature_chars)

    @field_validator("occurred_at")
    @classmethod
    def _aware_utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        try:
            return value.astimezone(timezone.utc)
        except OverflowError:  # an offset that moves it past the calendar's first or last day
            raise ValueError("outside the dates UTC can hold") from None

    @property
    def kind(self) -> str:
        """The part of `type` after the family, e.g. `advertised` for `shard.advertised`."""
        return self.type.split(".", 1)[1]  # type: ignore[attr-defined]
