"""RunnerChecks: what LayerRangeRunner checks before a step touches a cache (open, layers, input, position, room)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .errors import RunnerClosedError, SessionStateError, SessionTooLargeError


class RunnerChecks:
    """Mixed into LayerRangeRunner: reads its layers, static decoder, caches and accounting."""

    def _cached_length(self, cache, layer_index: int) -> int:
        return (self._static.cached_tokens(cache, layer_index) if self._static is not None
                else cache.layers[layer_index].get_seq_length())

    def _check_open(self) -> None:
        if self._closed:
            raise RunnerClosedError(f"runner for layers {self.layer_lo}-{self.layer_hi} is closed")

    def _validate_sub_range(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        if layers is None:
            return self.layer_lo, self.layer_hi
        run_lo, run_hi = layers
        if not (self.layer_lo <= run_lo <= run_hi <= self.layer_hi):
            raise ValueError(f"layers {run_lo}-{run_hi} are not inside the loaded range {self.layer_lo}-"
                             f"{self.layer_hi}")
        return run_lo, run_hi

    def _validate_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
            raise ValueError("hidden_states must be a floating-point tensor")
        shape = tuple(hidden_states.shape)
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != self.info.hidden_size:
            raise ValueError(f"hidden_states must have shape [1, T>=1, {self.info.hidden_size}], got {list(shape)}")
        return hidden_states.to(device=self.device, dtype=self.info.dtype, non_blocking=True)

    def _check_continues(self, session_id: str, cache: DynamicCache, start_pos: int, run_lo: int, run_hi: int) -> None:
        for layer_index in range(run_lo, run_hi + 1):
            cached = self._cached_length(cache, layer_index)
            if cached != start_pos:
                raise SessionStateError(f"session {session_id!r}: layer {layer_index} has {cached} cached tokens but "
                                        f"the step starts at position {start_pos}; re-prefill from position 0")

    def session_kv_bytes(self, positions: int, layers: tuple[int, int]) -> int:
        """The most KV-cache bytes a session of `positions` positions holds in the inclusive sub-range `layers`
        (sliding-window layers may hold less; a static cache holds all its positions from the start)."""
        run_lo, run_hi = self._validate_sub_range(layers)
        if self._static is not None:
            return self._static.cache_bytes_per_session(self._kv_bytes_per_token_per_layer, run_hi - run_lo + 1)
        return positions * self._kv_bytes_per_token_per_layer * (run_hi - run_lo + 1)

    def _check_fits(self, start_pos: int, num_tokens: int, run_lo: int, run_hi: int, *, cached_bytes: int) -> None:
        # Upper bound (sliding-window layers stop growing); enough to refuse a hopeless session up front. A static
        # cache takes all its positions at once, and a step past them fails here (a batched row alone, not its batch).
        context = self.info.max_positions
        if context is not None and start_pos + num_tokens > context:  # no honest step reaches past it
            raise SessionTooLargeError(f"positions {start_pos}..{start_pos + num_tokens - 1} go beyond the model's "
                                       f"context of {context} positions")
        layers = run_hi - run_lo + 1
        if self._static is not None:
            self._static.check_room(start_pos, num_tokens)
            projected = self._static.cache_bytes_per_session(self._kv_bytes_per_token_per_layer, layers)
        else:
            projected = cached_bytes + num_tokens * self._kv_bytes_per_token_per_layer * layers
        if projected > self._caches.budget_bytes:
            raise SessionTooLargeError(f"this step would take the session's KV cache to ~{projected} bytes, more than "
                                       f"the runner's whole budget of {self._caches.budget_bytes} bytes")

