"""The model-discovery messages of docs/protocol.md: what a request on `llm.models` asks and the mesh answers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModelsRequest(BaseModel):
    """A request on `llm.models` (an empty body is one too): which models can the mesh serve now?"""

    model_config = ConfigDict(extra="forbid")


class ServedModel(BaseModel):
    """One model the mesh knows of: which of its layers live shard hosts cover right now."""

    id: str
    total_layers: int = Field(ge=0)
    # Inclusive [lo, hi] layer ranges covered by live shards with the same weights, merged and sorted.
    covered_layers: list[tuple[int, int]] = Field(default_factory=list)
    # Every layer is covered: a pipeline can be built now.
    complete: bool
    weights_sha256: str | None = None
    # The weight quantization schemes live shards with those weights cover every layer in, most precise first;
    # covered_layers is of the first of them (or of the scheme that covers most layers when none is complete).
    quantizations: list[str] = Field(default_factory=list)
    # Positions the model takes (prompt plus generated tokens); None when the orchestrator cannot read its config.
    context_length: int | None = None
    # The orchestrator can also run it whole by itself (local fallback).
    runnable_locally: bool = False


class ModelsReply(BaseModel):
    """The answer on `llm.models`; `default_model` is what a request without `model` gets (set when exactly one
    model can be served now)."""

    models: list[ServedModel]
    default_model: str | None = None
    # The answering orchestrator's clock (Unix time, s), which a caller's signed calls are dated against ([events]
    # max_clock_skew_s): `hearth doctor` checks a caller's clock with it. None from an orchestrator before it.
    orchestrator_time_s: float | None = Field(default=None, allow_inf_nan=False)


DISCOVERY_MESSAGES = (ModelsRequest, ModelsReply)
