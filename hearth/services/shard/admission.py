"""Whether a shard takes one more hop: its streams, and each opener's share of them and of its KV-cache budget.

The KV share: every hop reserves the KV cache its session may reach (its open's `max_session_tokens` in the layers it
runs: no step of it goes further, hearth/services/transport/limits.py), and one opener's hops together reserve at most
`[shard] max_kv_share_per_opener` of the runner's budget, when that is set (without it a shard over-commits its budget
and evicts the least recently used idle session, which suits a mesh of one orchestrator member). Why reserve rather
than measure: caches grow step by step, so a member admitted while its sessions were short would grow them past its
share afterwards, and the runner then evicts the least recently used sessions, whoever's they are
(hearth/inference/sessions.py). A re-open counts too (its new session may be declared longer), less the hop it
replaces.
"""

from __future__ import annotations

from collections.abc import Collection

from hearth.inference import LayerRangeRunner
from hearth.inference.memory import megabytes
from hearth.protocol.control import ControlReply, OpenHop
from hearth.services.common.config import ShardSettings
from hearth.services.shard.hops import ServedHop


def admission_refusal(open_hops: Collection[ServedHop], request: OpenHop, opener: str | None,
                      replaced: ServedHop | None, settings: ShardSettings,
                      runner: LayerRangeRunner) -> ControlReply | None:
    """Why the hop `request` opens for `opener` (the member whose signature its open verified under; None on an open
    mesh) is not taken beside `open_hops`, or None. A re-open (`replaced`: the hop of its pipeline open now) takes the
    place of the hop it replaces, and only its KV share is asked."""
    limit = settings.max_concurrent_streams
    if replaced is None and len(open_hops) >= limit:
        return ControlReply(ok=False, code="at_capacity", message=f"{len(open_hops)} of {limit} streams in use")
    held, share = sum(hop.opener == opener for hop in open_hops), settings.hops_per_opener
    if replaced is None and opener is not None and held >= share:  # see [shard] max_hops_per_opener
        return ControlReply(ok=False, code="at_capacity",
                            message=f"this orchestrator holds {held} of the {limit} streams here, its most")
    return None if opener is None else _kv_share_refusal(open_hops, request, opener, replaced, settings, runner)


def kv_reserve_bytes(request: OpenHop, runner: LayerRangeRunner) -> int:
    """The KV cache a hop's session may reach here."""
    return runner.session_kv_bytes(request.max_session_tokens, (request.layer_lo, request.layer_hi))


def _kv_share_refusal(open_hops: Collection[ServedHop], request: OpenHop, opener: str, replaced: ServedHop | None,
                      settings: ShardSettings, runner: LayerRangeRunner) -> ControlReply | None:
    share = settings.kv_share_bytes(runner.cache_budget_bytes)
    if share is None:
        return None
    held = sum(kv_reserve_bytes(hop.request, runner) for hop in open_hops
               if hop.opener == opener and hop is not replaced)
    need = kv_reserve_bytes(request, runner)
    if held + need <= share:
        return None
    return ControlReply(ok=False, code="at_capacity", message=(
        f"this orchestrator's hops here reserve {megabytes(held):.2f} MB of KV cache; this session of "
        f"{request.max_session_tokens} positions would reserve {megabytes(need):.2f} MB more, past its share of "
        f"{megabytes(share):.2f} MB ([shard] max_kv_share_per_opener)"))
