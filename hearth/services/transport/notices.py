"""Authenticated hop notices: a hop MACs each HopNotice with the notice key its orchestrator told it alone at
`open`, and the orchestrator reads a notice only when the MAC fits the key of the hop the notice names, so no
member (another hop of the pipeline included) can speak for a hop it is not."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import ValidationError

from hearth.protocol.control import HopNotice
from hearth.services.transport.headers import oversized_headers
from hearth.services.transport.mac import mac_is_valid, with_mac

# A HopNotice's JSON at its largest (every field at its bound) is under 1 KiB; a larger body is not one.
max_notice_bytes = 2048

NoticeRefusal = Literal["malformed", "mac"]
NOTICE_REFUSALS: tuple[NoticeRefusal, ...] = ("malformed", "mac")


def notice_message(notice: HopNotice, notice_key: bytes | None) -> tuple[bytes, dict[str, str] | None]:
    """The payload and headers to publish `notice` with: `Hearth-Mac` over the payload, given the hop's key (an
    orchestrator from before notice keys gave none)."""
    payload = notice.model_dump_json().encode()
    return payload, (with_mac(notice_key, {}, payload) if notice_key is not None else None)


def read_notice(data: bytes, headers: Mapping[str, str] | None, *, pipeline_id: str, session_id: str,
                notice_keys: Sequence[bytes]) -> HopNotice | NoticeRefusal | None:
    """The notice a hop of this session sent; why it is refused (`malformed`, or `mac`: not sent by the hop it
    names); or None when it is about another pipeline or session (a late notice of an earlier one: not ours)."""
    if len(data) > max_notice_bytes or oversized_headers(headers):
        return "malformed"
    try:
        notice = HopNotice.model_validate_json(data)
    except ValidationError:
        return "malformed"
    if notice.pipeline_id != pipeline_id or notice.session_id != session_id:
        return None
    if notice.hop >= len(notice_keys) or not mac_is_valid(notice_keys[notice.hop], headers, data):
        return "mac"
    return notice
