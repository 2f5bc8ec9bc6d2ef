"""What a shard is (as advertised), and the `open` requests it cannot serve whatever else is open there."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.events.models import ShardAdvertised
from hearth.protocol.control import ControlReply, OpenHop
from hearth.protocol.mesh_protocol import MESH_PROTOCOL
from hearth.services.common.config_processes import ShardSettings


@dataclass(frozen=True)
class ShardIdentity:
    """What this shard is, as advertised."""

    shard_id: str
    model_id: str
    node_id: str
    weights_sha256: str
    layer_lo: int
    layer_hi: int
    total_layers: int
    dtype: str
    memory_required_mb: float
    control_subject: str
    device_kind: str | None = None
    device_name: str | None = None
    kv_cache_budget_mb: float | None = None
    # The weight quantization scheme's label ("none", "int8", "int4/g64").
    quantization: str = "none"


def advertisement(ident: ShardIdentity, settings: ShardSettings, hop_weight: float) -> ShardAdvertised:
    """The event that says this shard serves (published at start and again well inside its TTL)."""
    return ShardAdvertised(
        node_id=ident.node_id, shard_id=ident.shard_id, model_id=ident.model_id, weights_sha256=ident.weights_sha256,
        layer_lo=ident.layer_lo, layer_hi=ident.layer_hi, total_layers=ident.total_layers, dtype=ident.dtype,
        memory_required_mb=ident.memory_required_mb, max_concurrent_streams=settings.max_concurrent_streams,
        control_subject=ident.control_subject, hop_weight=hop_weight, ttl_s=settings.advertisement_ttl_s,
        device_kind=ident.device_kind, device_name=ident.device_name, kv_cache_budget_mb=ident.kv_cache_budget_mb,
        quantization=ident.quantization, protocol=MESH_PROTOCOL)


def open_refusal(request: OpenHop, ident: ShardIdentity, context: int | None,
                 requires_sealing: bool) -> ControlReply | None:
    """The refusal of an `open` this shard cannot serve whatever else is open here, or None."""
    if request.weights_sha256 != ident.weights_sha256 or request.model_id != ident.model_id:
        return ControlReply(ok=False, code="weights_mismatch",
                            message=f"this shard serves {ident.model_id} with weights {ident.weights_sha256}")
    if request.quantization is not None and request.quantization != ident.quantization:
        return ControlReply(ok=False, code="weights_mismatch",
                            message=f"this shard serves quantization {ident.quantization}, not {request.quantization}")
    if not (ident.layer_lo <= request.layer_lo <= request.layer_hi <= ident.layer_hi):
        return ControlReply(ok=False, code="bad_range",
                            message=f"layers {request.layer_lo}-{request.layer_hi} are not inside "
                                    f"{ident.layer_lo}-{ident.layer_hi}")
    if context is not None and request.max_session_tokens > context:
        # The hop's step limits (and so what its receiver may allocate) come from it.
        return ControlReply(ok=False, code="bad_request",
                            message=f"max_session_tokens {request.max_session_tokens} is beyond the model's "
                                    f"context of {context} positions")
    if requires_sealing and request.inbound_link_key is not None and not request.seal_activations:
        return ControlReply(ok=False, code="bad_request",
                            message="this shard seals activations ([transport] seal_activations): open the hop "
                                    "with seal_activations")
    return None
