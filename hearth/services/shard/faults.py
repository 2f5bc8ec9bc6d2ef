"""Deliberate misbehaviour a shard host can be started with, so failover, integrity checks and verification are
testable."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

if TYPE_CHECKING:
    from hearth.protocol.control import OpenHop

# The bit of a 16-bit output a `bitflip=B` fault flips for B >= 16: bfloat16 is float32's upper half, so bit B - 16 of
# it is float32's bit B (30, the top exponent bit, is bit 14 of either half-precision format).
half_precision_bit_offset = 16
float_view_dtypes = {4: torch.int32, 2: torch.int16}


class ShardFault(BaseModel):
    """`--fault` of `hearth shard`, e.g. `nan`, `scale=10000`, `delay_s=2.5`, `fail`, `after_steps=3,nan`,
    `noise=0.01,lie_rate=0.05,fault_seed=7`, `bitflip=30,spare_single_hop`.

    `fail` makes every step raise (as a crashing kernel or an out-of-memory error would) instead of passing
    anything on. `empty` passes on a tensor without positions (`[1, 0, hidden]`) and `misshape` one whose hidden
    dimension is one short: a faulty sender the next hop (or the orchestrator) must refuse at once. `accuse`
    claims that its sound input failed the norm check, as a host lying to get the hop before it blamed would.

    Subtle lies, as a malicious host would tell them: `scale=X` multiplies the output by X, `noise=S` adds Gaussian
    noise of S times each position's RMS (a relative error of about S), `offset=C` adds C to every element, and
    `bitflip=B` flips bit B of one element per position (a random one) in the output's float32 view; on a 16-bit
    output (bfloat16, float16) bit B - 16 of its 16-bit view for B >= 16 (the same bit of bfloat16; B = 30, the top
    exponent bit, is the top exponent bit of float16 too), bit B itself below 16.
    `lie_rate=P` corrupts only a random fraction P of the steps (drawn per step; `fault_seed=N` makes the draws,
    the noise and the flipped elements reproducible), `spare_single_hop` never corrupts the steps of a pipeline
    of one hop (what a verifier's re-run of one layer range looks like), as a liar dodging checks would, and
    `only_kept_prefix` corrupts only the steps of sessions that began from KV kept from an earlier call (where a
    liar may hope no other replica can follow it).

    Faults start after `after_steps` healthy steps so a test can break a shard mid-generation; `lie_rate` and
    `spare_single_hop` choose among the output corruptions only (not `fail`, `accuse` or `delay_s`).
    """

    model_config = ConfigDict(extra="forbid")

    nan: bool = False
    fail: bool = False
    accuse: bool = False
    empty: bool = False
    misshape: bool = False
    scale: float | None = Field(default=None, gt=0)
    noise: float | None = Field(default=None, gt=0)
    offset: float | None = None
    bitflip: int | None = Field(default=None, ge=0, le=31)
    lie_rate: float = Field(default=1.0, ge=0, le=1)
    fault_seed: int | None = None
    spare_single_hop: bool = False
    only_kept_prefix: bool = False
    delay_s: float = Field(default=0.0, ge=0)
    after_steps: int = Field(default=0, ge=0)
    steps_seen: int = 0
    _draws: random.Random = PrivateAttr()
    _generator: torch.Generator = PrivateAttr()

    def model_post_init(self, context: object, /) -> None:
        self._draws = random.Random(self.fault_seed)
        self._generator = torch.Generator()
        self._generator.manual_seed(self.fault_seed if self.fault_seed is not None else random.getrandbits(63))

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

    def corrupt(self, output: torch.Tensor, request: OpenHop | None = None, *,
                began_from_kept: bool = False) -> torch.Tensor:
        """The output this host passes on for a step it computed as `output` (of the hop opened by `request`, whose
        session `began_from_kept` KV of an earlier call or not)."""
        active = self.active
        self.steps_seen += 1
        if not active or not self._lies_about(request) or (self.only_kept_prefix and not began_from_kept):
            return output
        if self.nan:
            output = output.clone()
            output.view(-1)[0] = float("nan")
        if self.scale is not None:
            output = output * self.scale
        if self.noise is not None:
            output = self._with_noise(output, self.noise)
        if self.offset is not None:
            output = (output.float() + self.offset).to(output.dtype)
        if self.bitflip is not None:
            output = self._with_bit_flipped(output, self.bitflip)
        if self.empty:
            output = output[:, :0, :]
        if self.misshape:
            output = output[..., :-1]
        return output

    def _lies_about(self, request: OpenHop | None) -> bool:
        if self.spare_single_hop and request is not None and request.hop_count == 1:
            return False
        return self.lie_rate >= 1.0 or self._draws.random() < self.lie_rate

    def _with_noise(self, output: torch.Tensor, relative: float) -> torch.Tensor:
        exact = output.float()
        rms = exact.pow(2).mean(dim=-1, keepdim=True).sqrt()
        noise = torch.randn(exact.shape, generator=self._generator)
        return (exact + noise * rms * relative).to(output.dtype)

    def _with_bit_flipped(self, output: torch.Tensor, bit: int) -> torch.Tensor:
        if output.shape[-1] == 0 or output.numel() == 0:
            return output
        element_bytes = output.element_size()
        if element_bytes == 2 and bit >= half_precision_bit_offset:
            bit -= half_precision_bit_offset
        flipped = output.clone().contiguous()
        bits = flipped.view(float_view_dtypes[element_bytes]).view(-1, output.shape[-1])
        columns = torch.randint(output.shape[-1], (bits.shape[0],), generator=self._generator)
        rows = torch.arange(bits.shape[0])
        # XOR with the bit's mask; the sign bit's mask is the integer type's minimum (its top bit).
        mask = torch.tensor(1, dtype=bits.dtype) << bit
        bits[rows, columns] ^= mask
        return flipped
