"""Whose `open` a shard's control request is (the member's name and key), and the open with its keys unsealed, or the
refusal to answer it."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from hearth.protocol.control import ControlReply, OpenHop
from hearth.protocol.mesh_protocol import mesh_protocol_refusal
from hearth.services.common.call_signing import HEADER_CALLER, CallRefused
from hearth.services.transport.key_seal import keys_for_host
from hearth.trust.keys import MemberKey


def checked_open(msg: Msg, request: OpenHop, open_verifier: Any,
                 signing_key: MemberKey | None) -> tuple[str | None, str | None, OpenHop] | ControlReply:
    """Whose `open` this is (the name and key of the roster member whose key signed it; None, None on an open mesh,
    where opens are not told apart) and the open with its keys unsealed (hearth/services/transport/key_seal.py). An
    open no member signed (or one heard before) is refused: counted apart from the members, it would let one member
    at its share take the streams left to the others (every orchestrator of a community signs); so is one whose keys
    do not count, and one from an orchestrator of another mesh protocol version."""
    other_version = mesh_protocol_refusal(request.told_protocol(), "the orchestrator")
    if other_version is not None:  # before its signature: an older orchestrator's open is refused for what it is
        return ControlReply(ok=False, code="bad_request", message=other_version)
    opener = opener_key = None
    if open_verifier is not None:
        checked = open_verifier.check(msg.subject, "", msg.data, msg.headers)
        if isinstance(checked, CallRefused):
            return ControlReply(ok=False, code="unauthorized",
                                message=f"the open is not signed by a member ({checked.reason}): {checked.message}")
        opener, opener_key = checked.name, (msg.headers or {}).get(HEADER_CALLER)  # the key that verified
    opened = keys_for_host(request, signing_key, (msg.headers or {}).get(HEADER_CALLER))
    return (opener, opener_key, opened) if isinstance(opened, OpenHop) else ControlReply(ok=False, code="unauthorized",
                                                                           message=f"the open is refused: {opened}")
