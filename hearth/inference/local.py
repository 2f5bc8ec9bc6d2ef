"""LocalModel: a whole model on this machine (every layer plus the head) via the same runner/head code.

Used by the orchestrator's local fallback and by tests; the distributed path does the very same calls,
only with the runner's forward split over hops.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .detokenizer import TextDelta
from .head import Head
from .head_loading import load_head
from .loading import load_layer_range
from .quantization import QuantizationScheme
from .runner import LayerRangeRunner
from .sampling import SamplingParams


@dataclass
class LocalModel:
    """A runner over all layers and the head of one model."""

    runner: LayerRangeRunner
    head: Head

    @property
    def info(self):
        return self.head.info

    def generate_ids(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str | None = None
    ) -> Iterator[int]:
        """Yield up to ``params.max_tokens`` sampled token ids; stops after yielding a stop token id."""
        session_id = session_id or uuid.uuid4().hex
        generator = params.make_generator()
        stop_ids = self.head.stop_token_ids(params)
        try:
            hidden = self.runner.forward(session_id, self.head.embed(prompt_ids), 0, "prefill")
            position = len(prompt_ids)
            for _ in range(params.max_tokens):
                token_id = self.head.sample(self.head.logits(hidden), params, generator)
                yield token_id
                if token_id in stop_ids:
                    return
                hidden = self.runner.forward(session_id, self.head.embed([token_id]), position, "decode")
                position += 1
        finally:
            self.runner.reset(session_id)

    def generate_text(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[TextDelta]:
        """Yield text deltas until a stop token/string or max_tokens; the last delta has ``finished`` set."""
        stream = self.head.text_stream(params, prompt_ids)
        for token_id in self.generate_ids(prompt_ids, params):
            delta = stream.push(token_id)
            yield delta
            if delta.finished:
                return
        yield stream.finish()

    def close(self) -> None:
        self.runner.close()


def load_full(
    model: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    model_id: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
    quantization: str | QuantizationScheme = "none",
    cache_budget_bytes: int,
    session_ttl_s: float,
    **runner_options,
) -> LocalModel:
    """Every layer plus the head of ``model``, loaded by ``load_layer_range`` and ``load_head``.

    ``cache_budget_bytes`` and ``session_ttl_s`` bound the sessions' KV caches as ``load_layer_range``'s do;
    ``runner_options`` go to ``load_layer_range`` too (on_evict, clock).
    ``quantization`` ("none", "int8", "int4/g64", ...) applies to every layer, and int8 to the lm_head (load_head).
    """
    location = dict(
        model_id=model_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    head = load_head(model, dtype=dtype, device=device, quantization=quantization, **location)
    runner = load_layer_range(
        model,
        0,
        head.info.num_layers - 1,
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        quantization=quantization,
        cache_budget_bytes=cache_budget_bytes,
        session_ttl_s=session_ttl_s,
        **location,
        **runner_options,
    )
    return LocalModel(runner=runner, head=head)
