"""LayerPass: one step's hidden states going through a contiguous run of decoder layers over one session's cache,
all at once or a few layers at a time; SteppedForward: a step run in such passes, piece by piece of its tokens,
holding all of its own progress (LayerRangeRunner.advance runs it under the runner's checks).

Why in slices: a shard's steps share one compute thread (hearth/inference/compute_thread.py), so a long prefill chunk
run as one call holds every other session's decode step for the whole chunk on that hop. Run a layer or two per
call, the steps that arrived meanwhile get the thread between slices (hearth/services/shard/compute.py), and the wait a
long prompt imposes shrinks from a chunk's time on the hop to a slice's. The arithmetic is the same either way:
the rotary embedding and the masks are built once, against the cache as the step found it, and the layers run in
order on the same tensors, so a sliced pass is bitwise equal to an unsliced one.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .architectures import FULL_ATTENTION, SLIDING_ATTENTION
from .layer_call import build_mask, longer_extent, position_embeddings_by_type, run_decoder_layer
from .lean_decode import LeanDecoder, LeanSlot, verified_lean_decoder

MASK_BUILDERS = {
    FULL_ATTENTION: create_causal_mask,
    SLIDING_ATTENTION: create_sliding_window_causal_mask,
}


def step_masks(config: PretrainedConfig, attention_types: Sequence[str], cache: DynamicCache,
               hidden_states: torch.Tensor, position_ids: torch.Tensor, run_lo: int,
               run_hi: int) -> dict[str, object]:
    """The mask of each attention type in layers ``run_lo..run_hi`` for one session's step (``hidden_states`` at
    ``position_ids``), built by transformers' builder against `cache` as the step finds it."""
    masks: dict[str, object] = {}
    for layer_index in range(run_lo, run_hi + 1):
        attention_type = attention_types[layer_index]
        if attention_type not in masks:
            # Sized against a layer this runner actually fills: the cache's other layers stay empty.
            masks[attention_type] = build_mask(
                MASK_BUILDERS[attention_type], config=config, inputs_embeds=hidden_states, attention_mask=None,
                cache=cache, position_ids=position_ids, layer_idx=layer_index)
    return masks


@dataclass(frozen=True)
class DecoderStack:
    """The decoder layers of a runner and what every pass over them needs (read-only but for the rotary embedding)."""

    config: PretrainedConfig
    layers: dict[int, nn.Module]
    rotary_embedding: nn.Module
    attention_types: Sequence[str]
    # The runner's lock: a dynamic or longrope rotary embedding rewrites its frequencies for the positions asked
    # (transformers' dynamic_rope_update), so two passes must not build theirs at once.
    rotary_lock: threading.RLock
    # One-token steps without transformers' call machinery, where checked equal (hearth/inference/lean_decode.py).
    lean: LeanSlot | None = None

    def with_lean_decode(self, new_cache: Callable[[], DynamicCache]) -> DecoderStack:
        """This stack, its one-token steps run by a LeanDecoder if one checks out on caches from `new_cache` (checked
        at its first one-token pass, so that loading allocates nothing for it)."""
        stack = dataclasses.replace(self, lean=None)
        return dataclasses.replace(self, lean=LeanSlot(lambda: verified_lean_decoder(stack, new_cache)))

    def layer_pass(self, cache: DynamicCache, hidden_states: torch.Tensor, start_pos: int, run_lo: int,
                   run_hi: int, replay: bool = False, lean: bool = True, extent: int | None = None) -> LayerPass:
        """A pass of `hidden_states` (at `start_pos`) through layers ``run_lo..run_hi`` over `cache`; the layers
        themselves run unlocked. ``replay``: its queries attend as decode steps would (`LayerPass`). ``lean``: a
        one-token pass may run on the stack's LeanDecoder (the same numbers). ``extent``: the length of the sequence
        these tokens are a piece of, where the rotary embedding picks its frequencies by it (layer_call)."""
        with self.rotary_lock:
            return LayerPass(config=self.config, layers=self.layers, rotary_embedding=self.rotary_embedding,
                             attention_types=self.attention_types, cache=cache, hidden_states=hidden_states,
                             start_pos=start_pos, run_lo=run_lo, run_hi=run_hi, replay=replay, extent=extent,
                             lean=self.lean.decoder() if lean and self.lean and hidden_states.shape[1] == 1 else None)


class LayerPass:
    """Layers ``run_lo..run_hi`` (inclusive) of one step, run in order by `run` calls; call under inference mode.

    With ``replay``, each query of a full-attention layer attends its keys alone, as the decode step of its token did
    (hearth/inference/row_attention.py; a model not loaded under its implementation ignores the request): a session's
    tokens prefilled again after a failover then rebuild the cache their decode steps built, bit for bit where the
    projections are exact per row (int8, int4), instead of attention that blocks its sums over the keys otherwise."""

    def __init__(self, *, config: PretrainedConfig, layers: dict[int, nn.Module], rotary_embedding: nn.Module,
                 attention_types: Sequence[str], cache: DynamicCache, hidden_states: torch.Tensor, start_pos: int,
                 run_lo: int, run_hi: int, replay: bool = False, lean: LeanDecoder | None = None,
                 extent: int | None = None) -> None:
        self._replay = replay
        self._layers = layers
        self._attention_types = attention_types
        self._cache = cache
        self._run_hi = run_hi
        self._next_layer = run_lo
        self._hidden_states = hidden_states
        num_tokens = hidden_states.shape[1]
        self._position_ids = torch.arange(start_pos, start_pos + num_tokens,
                                          device=hidden_states.device).unsqueeze(0)
        self._position_embeddings = position_embeddings_by_type(
            rotary_embedding, hidden_states, self._position_ids, attention_types[run_lo:run_hi + 1],
            [longer_extent(extent, start_pos, num_tokens)], as_decoded=replay)
        # A single query attends every cached key, under no mask: the lean steps need none built.
        self._lean = lean
        self._lean_factors = None if self._lean is None else self._lean.factors(
            next(iter(self._position_embeddings.values())))
        self._masks = {} if self._lean is not None else step_masks(
            config, attention_types, cache, hidden_states, self._position_ids, run_lo, run_hi)

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
            if self._lean is not None:
                hidden_states = self._lean.run_layer(layer_index, hidden_states, [self._cache], self._lean_factors)
                continue
            attention_type = self._attention_types[layer_index]
            hidden_states = run_decoder_layer(
                self._layers[layer_index], hidden_states,
                attention_mask=self._masks[attention_type], position_ids=self._position_ids,
                cache=self._cache, position_embeddings=self._position_embeddings[attention_type],
                **({"hearth_replay": True} if self._replay and attention_type == FULL_ATTENTION else {}))
        self._hidden_states = hidden_states
        self._next_layer = last + 1
        return hidden_states if self.done else None


class SteppedForward:
    """A step begun by `LayerRangeRunner.begin_forward`: its tokens, the pieces run so far and the layer pass under way.
    `LayerRangeRunner.advance` runs its next layers (checked under the runner's lock, the layers outside it); the runner
    keeps none of the step's progress itself.

    With `piece_tokens`, the tokens not yet run go through the layers in a piece of that many before the rest (each
    piece's layers see the cache the pieces before it filled, as the orchestrator's chunks do), so that a turn is one
    layer of one piece: a long prompt's chunk then holds the compute thread for a fraction of a layer's time. Small
    pieces cost throughput on a CPU (a 64-row product of a layer's weights, and a cache that grows by more appends),
    so the caller picks the size piece by piece: small while others wait, the whole rest while none does.
    """

    def __init__(self, *, session_id: str, session, hidden_states: torch.Tensor, start_pos: int, run_lo: int,
                 run_hi: int, kind: str, stack: DecoderStack | None, prompt_tokens: int | None = None) -> None:
        self.session_id = session_id
        self.session = session  # the runner's record of the session, to notice it was evicted between advances
        self.hidden_states = hidden_states
        self.start_pos = start_pos
        self.run_lo, self.run_hi = run_lo, run_hi
        self.kind = kind
        # None: the step runs whole on its first advance (static caches: hearth/inference/static_decode.py).
        self.stack = stack
        self._total_tokens = hidden_states.shape[1]
        # What its pieces rotate as (layer_call): the whole step, or the prompt it is a chunk of.
        self.extent = max(start_pos + self._total_tokens, prompt_tokens or 0)
        self._outputs: list[torch.Tensor] = []
        self._done_tokens = 0
        self._piece: LayerPass | None = None

    @property
    def whole_step(self) -> tuple:
        """(hidden states, start position, first layer, last layer, kind, extent): what a static-cache step runs
        whole."""
        return self.hidden_states, self.start_pos, self.run_lo, self.run_hi, self.kind, self.extent

    def run(self, max_layers: int | None, piece_tokens: int | None) -> torch.Tensor | None:
        """Run the next `max_layers` layers of the current piece (everything when None), starting a piece of
        `piece_tokens` (all the tokens left when None) if none is under way; the step's output once the last piece has
        left its last layer. Under inference mode, outside the runner's lock; dynamic caches only."""
        while True:
            if self._piece is None:
                if self._done_tokens >= self._total_tokens:
                    raise RuntimeError("this layer pass has already run its last layer")
                end = self._done_tokens + (piece_tokens or self._total_tokens)
                piece = self.hidden_states[:, self._done_tokens:end]
                self._piece = self.stack.layer_pass(self.session.cache, piece, self.start_pos + self._done_tokens,
                                                    self.run_lo, self.run_hi, replay=self.kind == "replay",
                                                    extent=self.extent)
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
