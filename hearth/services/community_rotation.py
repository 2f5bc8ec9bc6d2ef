"""The steward's replacement of a member's key (`hearth community rotate-key`), its own `system` key's too: checked
against the roster, its `member.key_rotated` published on each event stream (hearth/services/community_removal.py, as
a removal of the old key alone, signed with the system key as it stands, so a rotation of that key is signed by the
old key and names the new one), then the new key and the old one's retirement written to the community folder."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

from hearth.services.community_removal import PublishedRemoval, publish_community_removal, rotation_events
from hearth.trust.keys import MemberKey, check_public_key
from hearth.trust.roster import SYSTEM_MEMBER, RosterError

if TYPE_CHECKING:
    from hearth.services.common.config import HearthSettings
    from hearth.trust.community import Community, RotatedKey


def rotate_member_key(community: Community, name: str, *, public_key: str | None, nats_url: str | None,
                      settings: HearthSettings, offline: bool) -> tuple[RotatedKey, PublishedRemoval]:
    """Give member `name` a new key (generated, or the member's own `public_key`) and retire its old one, published
    in the log first unless `offline`. RosterError or ValueError, with nothing changed, for an unknown or removed
    member, a key ever held here or one brought for the steward's own key (the folder must hold its seed); else
    what publish_community_removal and Community.rotate_key raise."""
    if name == SYSTEM_MEMBER and public_key is not None:
        raise RosterError(f"{name!r} is the steward's key, whose seed the community folder must hold (the broker's "
                          "tooling signs with it and the cluster's route password derives from it): run it without "
                          "--public-key, and a new one is made here")
    new_key: MemberKey | str = MemberKey.generate() if public_key is None else check_public_key(public_key)
    new_public_key = new_key if isinstance(new_key, str) else new_key.public_key
    # Refused here, before anything is published, as rotate_key would refuse it after.
    community.roster().with_rotated_key(name, new_public_key, retired_at=datetime.now(timezone.utc))
    published = PublishedRemoval()
    if not offline:
        published = publish_community_removal(community, name, nats_url, settings, rotation_events(new_public_key))
    # Retired where each stream holds the rotation (a cut); a stream without one cuts by the roster's time.
    began = published.found_since if not published.failures else None
    return community.rotate_key(name, new_key, cuts=published.cuts, retired_at=began), published
