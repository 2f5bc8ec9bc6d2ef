"""Request/reply messages on a shard's control subject (DESIGN.md §6): open and close a pipeline hop."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from events.models import SUBJECT_TOKEN_PATTERN

RefusalCode = Literal["at_capacity", "weights_mismatch", "bad_range", "bad_request", "unknown_pipeline"]


class OpenHop(BaseModel):
    """Ask a shard to serve hop `hop` of a pipeline: run layers lo..hi of one session's steps."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["open"] = "open"
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    hop: int = Field(ge=0)
    hop_count: int = Field(ge=1)
    model_id: str
    weights_sha256: str
    layer_lo: int = Field(ge=0)
    layer_hi: int = Field(ge=0)
    # Wire dtype for this hop's output: "auto" keeps the compute dtype (lossless).
    wire_dtype: Literal["auto", "fp16", "fp32", "int8"] = "auto"
    max_session_tokens: int = Field(default=8192, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "OpenHop":
        if self.layer_hi < self.layer_lo:
            raise ValueError("layer_hi must be >= layer_lo")
        if self.hop >= self.hop_count:
            raise ValueError("hop must be < hop_count")
        return self


class CloseHop(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: Literal["close"] = "close"
    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)


ControlRequest = Annotated[Union[OpenHop, CloseHop], Field(discriminator="op")]
control_request_adapter: TypeAdapter[ControlRequest] = TypeAdapter(ControlRequest)


class ControlReply(BaseModel):
    ok: bool
    code: RefusalCode | None = None
    message: str = ""
    shard_id: str = ""


def integrity_subject(pipeline_id: str) -> str:
    return f"hearth.integrity.{pipeline_id}"


class IntegrityNotice(BaseModel):
    """A hop found its input corrupted: the hop before it (or the orchestrator, for hop 0) produced it."""

    pipeline_id: str = Field(pattern=SUBJECT_TOKEN_PATTERN)
    session_id: str
    hop: int = Field(ge=0)
    step: int = Field(ge=0)
    check: Literal["nan", "inf", "norm"]
