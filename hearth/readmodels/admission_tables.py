"""The read-model tables of what a projection admits (hearth/readmodels/admission.py): the events it rejected, the
removals and key rotations the log showed, and the ids of the events it applied. Same conventions as
hearth/readmodels/tables.py."""

from __future__ import annotations

from sqlalchemy import Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from hearth.readmodels.table_base import Base


class RejectedEvent(Base):
    """An event a projection did not apply: unsigned, signed by a non-member or a removed one, by a role that may not
    emit its type, for another node or stream, or dated in the future (hearth/events/signing.py); or a copy of an
    event applied already, or older than its id is kept (applied_events); or one only a newer hearth reads
    (`newer_hearth`, `type` naming it: events/newer_hearth.py). Its position still advanced. A sample: the
    first few of each reason in each minute of each stream (rejected_event_counts counts them all)."""

    __tablename__ = "rejected_events"

    stream: Mapped[str] = mapped_column(String, primary_key=True)
    stream_seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    event_id: Mapped[str] = mapped_column(String, nullable=False)
    type: Mapped[str] = mapped_column(String, nullable=False)
    node_id: Mapped[str] = mapped_column(String, nullable=False, comment="the node the event claims")
    signer: Mapped[str | None] = mapped_column(String, comment="the public key it names (NULL: unsigned)")
    reason: Mapped[str] = mapped_column(
        String, nullable=False,
        comment="unsigned | unknown_signer | removed_signer | bad_signature | role_may_not_emit | node_mismatch | "
                "wrong_stream | future_dated | unapplicable | duplicate | too_old | newer_hearth",
    )
    occurred_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s the event claims")
    rejected_at: Mapped[int] = mapped_column(
        Integer, nullable=False,
        comment="epoch s the stream stored it (from the log, not the clock, so a rebuild gives the same row)",
    )

    __table_args__ = (Index(None, "reason"), Index(None, "stream", "rejected_at"))


class RejectedEventCount(Base):
    """How many events of one stream a projection rejected for one reason per minute of `rejected_at` (when the
    stream stored them): exact however many come, where rejected_events keeps only samples."""

    __tablename__ = "rejected_event_counts"

    minute: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s, a multiple of 60")
    stream: Mapped[str] = mapped_column(String, primary_key=True)
    reason: Mapped[str] = mapped_column(String, primary_key=True)
    events: Mapped[int] = mapped_column(Integer, nullable=False)


class MemberRemoval(Base):
    """A member's removal as one stream's log shows it: a `member.removed` signed by a steward. What that member's key
    signed and the stream stored after it is rejected (`removed_signer`), whatever the roster file says yet."""

    __tablename__ = "member_removals"

    stream: Mapped[str] = mapped_column(String, primary_key=True, comment="the stream whose position it marks")
    public_key: Mapped[str] = mapped_column(String, primary_key=True, comment="the removed member's key")
    member: Mapped[str] = mapped_column(String, nullable=False, comment="its name (node id)")
    event_id: Mapped[str] = mapped_column(String, nullable=False, comment="the first removal event of it there")
    removed_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s the steward says")


class StewardKey(Base):
    """A steward key as one stream's log names it: a verified `member.key_rotated` of the `system` member, signed by
    the key it retires, passes the steward's role to its new key there (hearth/events/steward_keys.py), whatever the
    roster file says yet."""

    __tablename__ = "steward_keys"

    stream: Mapped[str] = mapped_column(String, primary_key=True, comment="the stream whose log names it")
    public_key: Mapped[str] = mapped_column(String, primary_key=True, comment="the new steward key")
    succeeds: Mapped[str] = mapped_column(String, nullable=False, comment="the steward key it replaced there")
    event_id: Mapped[str] = mapped_column(String, nullable=False, comment="the rotation that named it")
    rotated_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s the steward says")


class MemberKey(Base):
    """A member's key as one stream's log names it: a verified `member.key_rotated` of a member other than the steward
    (signed by a steward key) passes that member's role to its new key there (hearth/events/member_keys.py), whatever
    the roster file says yet."""

    __tablename__ = "member_keys"

    stream: Mapped[str] = mapped_column(String, primary_key=True, comment="the stream whose log names it")
    public_key: Mapped[str] = mapped_column(String, primary_key=True, comment="the member's new key")
    member: Mapped[str] = mapped_column(String, nullable=False, comment="the member's name (node id)")
    succeeds: Mapped[str] = mapped_column(String, nullable=False, comment="the member's key it replaced there")
    event_id: Mapped[str] = mapped_column(String, nullable=False, comment="the rotation that named it")
    rotated_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s the steward says")


class MemberAddition(Base):
    """A member as one stream's log adds it: a verified `member.added` (signed by a steward key) makes its key that
    member's there (hearth/events/member_additions.py), whatever the roster file says yet."""

    __tablename__ = "member_additions"

    stream: Mapped[str] = mapped_column(String, primary_key=True, comment="the stream whose log adds it")
    public_key: Mapped[str] = mapped_column(String, primary_key=True, comment="the member's key")
    member: Mapped[str] = mapped_column(String, nullable=False, comment="the member's name (node id)")
    role: Mapped[str] = mapped_column(String, nullable=False, comment="its role, as the roster would give it")
    trust: Mapped[str] = mapped_column(String, nullable=False, comment="its trust level, as the roster would give it")
    event_id: Mapped[str] = mapped_column(String, nullable=False, comment="the addition that added it")
    added_at: Mapped[int] = mapped_column(Integer, nullable=False, comment="epoch s the steward says")


class AppliedEvent(Base):
    """An event a projection applied, by its id on its stream (hearth/readmodels/applied_events.py): a copy stored
    again past the broker's duplicate window is rejected `duplicate`, not counted twice. Kept as long as its stream's
    history; an event older than that is refused `too_old`, so no copy outlives its id.

    Keyed by time first, without a rowid: one B-tree, appended to at its end as events come in time order, pruned
    from its start. A copy of a signed event claims the time the original did (the signature covers it)."""

    __tablename__ = "applied_events"

    stream: Mapped[str] = mapped_column(String, primary_key=True)
    occurred_at: Mapped[int] = mapped_column(Integer, primary_key=True, comment="epoch s the event claims")
    event_id: Mapped[str] = mapped_column(String, primary_key=True)

    __table_args__ = {"sqlite_with_rowid": False}
