"""Deliberate misbehaviour a shard host can be started with, so failover and integrity checks are testable."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class ShardFault(BaseModel):
    """`--fault` of `hearth shard`, e.g. `nan`, `scale=10000`, `delay_s=2.5`, `fail`, `after_steps=3,nan`.

    `fail` makes every step raise (as a crashing kernel or an out-of-memory error would) instead of passing
    anything on. `empty` passes on a tensor without positions (`[1, 0, hidden]`) and `misshape` one whose hidden
    dimension is one short: a faulty sender the next hop (or the orchestrator) must refuse at once. `accuse`
    claims that its sound input failed the norm check, as a host lying to get the hop before it blamed would.

    Faults start after `after_steps` healthy steps so a test can break a shard mid-generation.
    """

    model_config = ConfigDict(extra="forbid")

    nan: bool = False
    fail: bool = False
    accuse: bool = False
    empty: bool = False
    misshape: bool = False
    scale: float | None = Field(default=None, gt=0)
    delay_s: float = Field(default=0.0, ge=0)
    after_steps: int = Field(default=0, ge=0)
    steps_seen: int = 0

    @classmethod
    def parse(cls, spec: str | None) -> "ShardFault":
        if not spec:
            return cls()
        fields: dict[str, object] = {}
        for part in spec.split(","):
            name, _, value = part.strip().partition("=")
            fields[name] = value if value else True
        return cls.model_validate(fields)

    @property
    def active(self) -> bool:
        return self.steps_seen >= self.after_steps

    def raise_if_failing(self) -> None:
        """On the compute thread, before the layers run: raise when the `fail` fault is active."""
        if self.fail and self.active:
            raise RuntimeError("injected step failure (--fault fail)")

    def corrupt(self, output: torch.Tensor) -> torch.Tensor:
        active = self.active
        self.steps_seen += 1
        if not active:
            return output
        if self.nan:
            output = output.clone()
            output.view(-1)[0] = float("nan")
        if self.scale is not None:
            output = output * self.scale
        if self.empty:
            output = output[:, :0, :]
        if self.misshape:
            output = output[..., :-1]
        return output
