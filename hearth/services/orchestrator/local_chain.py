"""LocalChain: HopChain's step interface over a whole model on the orchestrator's machine (the local fallback)."""

from __future__ import annotations

import uuid

import torch

from hearth.inference import LocalModel, SessionEvictedError
from hearth.inference.compute_thread import on_compute_thread
from hearth.services.orchestrator.outcomes import StepFailure
from hearth.services.transport import FrameKind


class LocalChain:
    """The same step interface over a whole model on this machine (local fallback); a step fails only when its
    session was evicted."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.session_id = "local-" + uuid.uuid4().hex[:16]
        self.shard_ids: list[str] = []
        self.replay_steps = True

    async def keep_alive(self) -> None:
        return None

    async def step(self, kind: FrameKind, pos: int, hidden: torch.Tensor,
                   prompt_tokens: int | None = None) -> torch.Tensor | StepFailure:
        """The step's output, or `evicted` when another local call's cache pushed this one out of the KV budget the
        local model's calls share (the call re-prefills, as after a hop's `session_evicted`)."""
        try:
            return await on_compute_thread(self.local.runner.forward, self.session_id, hidden, pos, kind.value, None,
                                           prompt_tokens)
        except SessionEvictedError as error:
            return StepFailure("evicted", None, f"the local model's session was evicted: {error}")

    async def close(self) -> None:
        await on_compute_thread(self.local.runner.reset, self.session_id)
