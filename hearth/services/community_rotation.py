"""The steward's replacement of a member's key (`hearth community rotate-key`), its own `system` key's too: checked
against the roster, its `member.key_rotated` published on each event stream (hearth/services/community_removal.py, as
a removal of the old key alone, after the member's earlier changes that stream's log lacks, signed with the system key
as it stands, so a rotation of that key is signed by the old key and names the new one), then the new key and the old
one's retirement written to the community folder. A generated key's seed is kept pending beside the roster until then
(hearth/trust/pending_rotation.py), and a rerun reuses it, so the roster names the key the log's rotation names
however often it is run."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

from hearth.services.community_removal import (
    EarlierRemovalDiffers,
    PublishedRemoval,
    publish_community_removal,
    rotation_differs,
    rotation_events,
)
from hearth.services.community_pending import earlier_changes
from hearth.trust.keys import MemberKey, check_public_key
from hearth.trust.pending_rotation import discard_pending_seed, keep_pending_seed, pending_seed, pending_seed_path
from hearth.trust.roster import SYSTEM_MEMBER, RosterError

if TYPE_CHECKING:
    from hearth.services.common.config import HearthSettings
    from hearth.trust.community import Community, RotatedKey


def rotate_member_key(community: Community, name: str, *, public_key: str | None, nats_url: str | None,
                      settings: HearthSettings, offline: bool) -> tuple[RotatedKey, PublishedRemoval]:
    """Give member `name` a new key (generated, or the member's own `public_key`) and retire its old one, published
    in the log first unless `offline`. RosterError or ValueError, with nothing changed, for an unknown or removed
    member, a key ever held here, one brought for the steward's own key (the folder must hold its seed) or while a
    generated one is pending; EarlierRemovalDiffers, with nothing published or changed, when the log already rotates
    the key to another; else what publish_community_removal and Community.rotate_key raise."""
    if name == SYSTEM_MEMBER and public_key is not None:
        raise RosterError(f"{name!r} is the steward's key, whose seed the community folder must hold (the broker's "
                          "tooling signs with it and the cluster's route password derives from it): run it without "
                          "--public-key, and a new one is made here")
    directory = community.directory
    member = community.roster().by_name(name)
    pending = pending_seed(directory, member) if member is not None else None
    if pending is not None and public_key is not None:
        raise RosterError(f"{pending_seed_path(directory, name)} holds the new seed of a rotation of {name}'s key "
                          "under way, whose event a stream may hold: run it again without --public-key to finish it "
                          "(or delete that file first, if no stream holds its rotation)")
    new_key: MemberKey | str = check_public_key(public_key) if public_key is not None else (
        pending or MemberKey.generate())
    new_public_key = new_key if isinstance(new_key, str) else new_key.public_key
    # Refused here, before anything is published, as rotate_key would refuse it after.
    community.roster().with_rotated_key(name, new_public_key, retired_at=datetime.now(timezone.utc))
    published = PublishedRemoval()
    if not offline:
        if isinstance(new_key, MemberKey) and member is not None:
            # Kept before the event names it: a rerun after a failure makes the roster name the same key.
            keep_pending_seed(directory, member, new_key)
        try:
            published = publish_community_removal(community, name, nats_url, settings,
                                                  rotation_events(new_public_key), rotation_differs(new_public_key),
                                                  earlier=earlier_changes)
        except EarlierRemovalDiffers:
            if isinstance(new_key, MemberKey):  # the log's first rotation names another key: this one never counts
                discard_pending_seed(directory, name)
            raise
    # Retired where each stream holds the rotation (a cut); a stream without one cuts by the roster's time.
    began = published.found_since if not published.failures else None
    return community.rotate_key(name, new_key, cuts=published.cuts, retired_at=began), published
