"""LayerPass: one step's hidden states going through a contiguous run of decoder layers over one session's cache,
all at once or a few layers at a time.

Why in slices: a shard's steps share one compute thread (inference/compute_thread.py), so a long prefill chunk
run as one call holds every other session's decode step for the whole chunk on that hop. Run a layer or two per
call, the steps that arrived meanwhile get the thread between slices (services/shard/compute.py), and the wait a
long prompt imposes shrinks from a chunk's time on the hop to a slice's. The arithmetic is the same either way:
the rotary embedding and the masks are built once, against the cache as the step found it, and the layers run in
order on the same tensors, so a sliced pass is bitwise equal to an unsliced one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .architectures import FULL_ATTENTION, SLIDING_ATTENTION
from .layer_call import build_mask, run_decoder_layer

MASK_BUILDERS = {
    FULL_ATTENTION: create_causal_mask,
    SLIDING_ATTENTION: create_sliding_window_causal_mask,
}


class LayerPass:
    """Layers ``run_lo..run_hi`` (inclusive) of one step, run in order by `run` calls; call under inference mode."""

    def __init__(self, *, config: PretrainedConfig, layers: dict[int, nn.Module], rotary_embedding: nn.Module,
                 attention_types: Sequence[str], cache: DynamicCache, hidden_states: torch.Tensor, start_pos: int,
                 run_lo: int, run_hi: int) -> None:
        self._layers = layers
        self._attention_types = attention_types
        self._cache = cache
        self._run_hi = run_hi
        self._next_layer = run_lo
        self._hidden_states = hidden_states
        num_tokens = hidden_states.shape[1]
        self._position_ids = torch.arange(start_pos, start_pos + num_tokens,
                                          device=hidden_states.device).unsqueeze(0)
        self._position_embeddings = rotary_embedding(hidden_states, self._position_ids)
        self._masks = {}
        for layer_index in range(run_lo, run_hi + 1):
            attention_type = attention_types[layer_index]
            if attention_type not in self._masks:
                # Sized against a layer this runner actually fills: the cache's other layers stay empty.
                self._masks[attention_type] = build_mask(
                    MASK_BUILDERS[attention_type], config=config, inputs_embeds=hidden_states, attention_mask=None,
                    cache=cache, position_ids=self._position_ids, layer_idx=layer_index)

    @property
    def done(self) -> bool:
        return self._next_layer > self._run_hi

    @property
    def layers_left(self) -> int:
        return self._run_hi - self._next_layer + 1

    def run(self, max_layers: int | None = None) -> torch.Tensor | None:
        """Run the next `max_layers` layers (all that are left when None); the output once the last one has run."""
        if self.done:
            raise RuntimeError("this layer pass has already run its last layer")
        if max_layers is not None and max_layers < 1:
            raise ValueError(f"max_layers must be at least 1, got {max_layers}")
        last = self._run_hi if max_layers is None else min(self._run_hi, self._next_layer + max_layers - 1)
        hidden_states = self._hidden_states
        for layer_index in range(self._next_layer, last + 1):
            hidden_states = run_decoder_layer(
                self._layers[layer_index], hidden_states,
                attention_mask=self._masks[self._attention_types[layer_index]], position_ids=self._position_ids,
                cache=self._cache, position_embeddings=self._position_embeddings)
        self._hidden_states = hidden_states
        self._next_layer = last + 1
        return hidden_states if self.done else None


class SteppedForward:
    """A step begun by `LayerRangeRunner.begin_forward`; each `advance` runs its next layers (checked under the
    runner's lock, the layers outside it).

    With `piece_tokens`, the tokens not yet run go through the layers in a piece of that many before the rest (each
    piece's layers see the cache the pieces before it filled, as the orchestrator's chunks do), so that a turn is one
    layer of one piece: a long prompt's chunk then holds the compute thread for a fraction of a layer's time. Small
    pieces cost throughput on a CPU (a 64-row product of a layer's weights, and a cache that grows by more appends),
    so the caller picks the size piece by piece: small while others wait, the whole rest while none does.
    """

    def __init__(self, advance: Callable[[SteppedForward, int | None, int | None], torch.Tensor | None],
                 session_id: str,
                 session, whole_step: tuple, new_pass: Callable[[torch.Tensor, int], LayerPass] | None) -> None:
        self._advance = advance
        self.session_id = session_id
        self.session = session  # the runner's record of the session, to notice it was evicted between advances
        # (hidden states, start position, first layer, last layer, kind): what a static-cache step runs whole.
        self.whole_step = whole_step
        # None: the step runs whole on its first advance (static caches: inference/static_decode.py).
        self.new_pass = new_pass
        hidden_states = whole_step[0]
        self._total_tokens = hidden_states.shape[1]
        self._outputs: list[torch.Tensor] = []
        self._done_tokens = 0
        self._piece: LayerPass | None = None

    def advance(self, max_layers: int | None = None, piece_tokens: int | None = None) -> torch.Tensor | None:
        """Run the next `max_layers` layers of the current piece (everything when None), starting a piece of
        `piece_tokens` (all the tokens left when None) if none is under way; the step's output once the last piece has
        left its last layer."""
        if piece_tokens is not None and piece_tokens < 1:
            raise ValueError(f"piece_tokens must be at least 1, got {piece_tokens}")
        return self._advance(self, max_layers, piece_tokens)

    def run(self, max_layers: int | None, piece_tokens: int | None) -> torch.Tensor | None:
        """What `advance` runs under inference mode (dynamic caches only; outside the runner's lock)."""
        while True:
            if self._piece is None:
                if self._done_tokens >= self._total_tokens:
                    raise RuntimeError("this layer pass has already run its last layer")
                hidden_states, start_pos = self.whole_step[0], self.whole_step[1]
                piece = hidden_states[:, self._done_tokens:self._done_tokens + (piece_tokens or self._total_tokens)]
                self._piece = self.new_pass(piece, start_pos + self._done_tokens)
            output = self._piece.run(max_layers)
            if output is None:
                return None
            self._piece = None
            self._outputs.append(output)
            self._done_tokens += output.shape[1]
            if self._done_tokens >= self._total_tokens:
                return self._outputs[0] if len(self._outputs) == 1 else torch.cat(self._outputs, dim=1)
            if max_layers is not None:
                return None
