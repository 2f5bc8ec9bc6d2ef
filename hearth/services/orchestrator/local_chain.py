"""LocalChain: HopChain's step interface over a whole model on the orchestrator's machine (the local fallback)."""

from __future__ import annotations

import uuid

import torch

from hearth.inference import LocalModel
from hearth.inference.compute_thread import on_compute_thread
from hearth.services.transport import FrameKind


class LocalChain:
    """The same step interface over a whole model on this machine (local fallback); it never fails a step."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.session_id = "local-" + uuid.uuid4().hex[:16]
        self.shard_ids: list[str] = []
        self.replay_steps = True

    async def keep_alive(self) -> None:
        return None

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor,
                   prompt_tokens: int | None = None) -> torch.Tensor:
        return await on_compute_thread(self.local.runner.forward, self.session_id, hidden, pos, kind.value, None,
                                       prompt_tokens)

    async def close(self) -> None:
        await on_compute_thread(self.local.runner.reset, self.session_id)
