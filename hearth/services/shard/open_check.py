"""A shard's control request as it reads it: decoded or refused as `bad_request` in one line, whose `open` it is (the
member's name and key), and the open with its keys unsealed, or the refusal to answer it."""

from __future__ import annotations

import json
from typing import Any

from nats.aio.msg import Msg
from pydantic import ValidationError

from hearth.protocol.bounds import max_reason_chars
from hearth.protocol.control import ControlReply, ControlRequest, OpenHop, control_request_adapter
from hearth.protocol.mesh_protocol import MESH_PROTOCOL, max_mesh_protocol, mesh_protocol_refusal
from hearth.protocol.refusals import describe_validation_error
from hearth.services.common.call_signing import HEADER_CALLER, CallRefused
from hearth.services.transport.key_seal import keys_for_host
from hearth.trust.keys import MemberKey


def decoded_control_request(data: bytes) -> ControlRequest | ControlReply:
    """The control request `data` holds, or its refusal: `bad_request` naming the fields in one line (not their
    values), or saying that an `open` speaks another mesh protocol (open_of_another_version)."""
    try:
        return control_request_adapter.validate_json(data)
    except ValidationError as error:
        return open_of_another_version(data) or ControlReply(
            ok=False, code="bad_request", message=describe_validation_error(error)[:max_reason_chars])


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


def open_of_another_version(data: bytes) -> ControlReply | None:
    """The refusal of a control request that does not validate but is an `open` of another mesh protocol (a newer
    orchestrator's, with fields this shard does not know, or one from before protocol versions): refused for what it
    is, as checked_open refuses one that validates, not for a field this shard cannot read. None otherwise."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("op") != "open":
        return None
    told = body.get("protocol")
    if told is not None and (not isinstance(told, int) or isinstance(told, bool) or not 1 <= told <= max_mesh_protocol):
        return None  # no version at all: the validation error says what is wrong
    if told == MESH_PROTOCOL:
        return None
    return ControlReply(ok=False, code="bad_request", message=mesh_protocol_refusal(told, "the orchestrator"))
