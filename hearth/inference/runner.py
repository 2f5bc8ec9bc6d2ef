"""LayerRangeRunner: runs a contiguous range of decoder layers for many sessions, each with a KV cache."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from .architectures import ArchitectureAdapter
from .checkpoint import ModelInfo
from .batched import BatchRow, StackingBuffers, batched_steps_supported, run_batched_step
from .layer_pass import MASK_BUILDERS, DecoderStack, SteppedForward
from .errors import InferenceError, SessionEvictedError, SessionStateError
from .kv_growth import dynamic_cache_maker
from .quantization import held_tensor_bytes
from .prefix_cache import CacheLengths, PrefixCache, PrefixSessions
from .sessions import EvictedSession, SessionCaches, as_position, kv_bytes_per_token_per_layer
from .runner_checks import RunnerChecks
from .runner_sessions import RunnerSessions
from .static_decode import StaticCacheLengths, StaticDecoder, static_decode_supported

# "replay": a session's decoded tokens prefilled again (a failover), query by query as their decode steps ran.
StepKind = Literal["prefill", "decode", "replay"]
STEP_KINDS: tuple[str, ...] = ("prefill", "decode", "replay")


class LayerRangeRunner(RunnerChecks, RunnerSessions):
    """Decoder layers ``layer_lo..layer_hi`` (inclusive, global indices) plus per-session KV caches.

    ``forward`` takes the hidden states entering ``layer_lo`` (or the first layer of a requested sub-range) and returns
    those leaving the last layer run. Every public method takes one lock, so the runner can be driven from worker
    threads (e.g. ``asyncio.to_thread``); the layers of a dynamic-cache step (`begin_forward`, then `advance` until it
    returns the output) run outside it, so steps of different sessions may run side by side.

    Cache rules: a ``prefill`` at ``start_pos`` 0 (re)starts the session; any other step must continue it exactly
    (``start_pos`` equal to the tokens already cached in every layer it runs), otherwise ``SessionStateError``. Sessions
    idle longer than ``session_ttl_s`` are evicted, and the least recently used ones are evicted when all caches
    together exceed ``cache_budget_bytes``.
    """
    quantization: str = "none"  # the label of its Linears' scheme (hearth/inference/quantization.py); set when loaded

    def __init__(
        self,
        *,
        info: ModelInfo,
        config: PretrainedConfig,
        adapter: ArchitectureAdapter,
        layers: dict[int, nn.Module],
        rotary_embedding: nn.Module,
        loaded_tensor_names: tuple[str, ...],
        layer_name_prefix: str = "model.layers.",
        checkpoint_bytes_read: int = 0,
        device: torch.device | None = None,
        cache_budget_bytes: int,
        session_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[EvictedSession], None] | None = None,
        static_cache_tokens: int | None = None,
        prefix_ttl_s: float | None = None,
    ):
        self.info = info
        self.layer_lo, self.layer_hi = min(layers), max(layers)
        self.loaded_tensor_names = loaded_tensor_names
        self._layer_prefix = layer_name_prefix
        self.checkpoint_bytes_read = checkpoint_bytes_read
        # Where the layers and caches live; steps arriving elsewhere (the wire hands over CPU tensors) move here.
        self.device = device or torch.device("cpu")
        self._attention_types = adapter.attention_types(config)
        own_types = self._attention_types[self.layer_lo : self.layer_hi + 1]
        unknown = set(own_types) - set(MASK_BUILDERS)
        if unknown:
            raise ValueError(f"attention types {sorted(unknown)} are not supported by LayerRangeRunner")
        self._kv_bytes_per_token_per_layer = kv_bytes_per_token_per_layer(config, info.dtype)
        # Re-entrant so an on_evict callback may read the runner's accounting without deadlocking.
        self._lock = threading.RLock()
        self._closed = False
        # Static caches and graphed decode steps (hearth/inference/static_decode.py) where asked for and supported.
        self._static: StaticDecoder | None = None
        if static_cache_tokens and static_decode_supported(config, own_types):
            # No session reaches beyond the model's context, so neither need its cache.
            max_tokens = min(static_cache_tokens, getattr(config, "max_position_embeddings", 0) or static_cache_tokens)
            self._static = StaticDecoder(config=config, layers=layers, rotary_embedding=rotary_embedding,
                                         max_tokens=max_tokens, device=self.device, capture_graphs=True)
        stack = DecoderStack(config=config, layers=layers, rotary_embedding=rotary_embedding,
                             attention_types=self._attention_types, rotary_lock=self._lock)
        # One-token steps over caches that grow in place: the lean path where it checks out (lean_decode.py).
        dynamic_cache, grows = dynamic_cache_maker(config, self.device)
        self._stack = stack if self._static is not None or not grows else stack.with_lean_decode(dynamic_cache)
        # Batched steps over the sessions' own dynamic caches (hearth/inference/batched.py; static ones: StaticDecoder).
        self._batched = self._static is None and batched_steps_supported(config, own_types)
        self._stacking_buffers = StackingBuffers()  # used under the lock: step_batch holds it throughout
        # Kept prefixes (hearth/inference/prefix_cache.py), in dynamic and static caches alike.
        prefixes = PrefixCache(ttl_s=prefix_ttl_s, clock=clock) if prefix_ttl_s else None
        self._caches = SessionCaches(
            self._static.new_cache if self._static is not None else dynamic_cache,
            range(self.layer_lo, self.layer_hi + 1), budget_bytes=cache_budget_bytes, ttl_s=session_ttl_s,
            clock=clock, on_evict=on_evict, prefixes=prefixes, session_reserve_bytes=self.static_session_bytes or 0)
        lengths = StaticCacheLengths(self._static) if self._static is not None else CacheLengths()
        self._prefix_sessions = PrefixSessions(self._caches, prefixes, lengths) if prefixes is not None else None

    # ----------------------------------------------------------------- compute

    def forward(self, session_id: str, hidden_states: torch.Tensor, start_pos: int, kind: StepKind = "prefill",
                layers: tuple[int, int] | None = None, prompt_tokens: int | None = None) -> torch.Tensor:
        """Run one step of a session through the loaded layers (or the inclusive sub-range ``layers``).

        ``hidden_states`` is ``[1, T, hidden_size]`` for the T tokens at positions ``start_pos .. start_pos+T-1``;
        the result has the same shape, in the model's dtype. ``prompt_tokens``: the prompt's length (layer_call)."""
        return self.advance(self.begin_forward(session_id, hidden_states, start_pos, kind, layers, prompt_tokens))

    def begin_forward(self, session_id: str, hidden_states: torch.Tensor, start_pos: int, kind: StepKind = "prefill",
                      layers: tuple[int, int] | None = None, prompt_tokens: int | None = None) -> SteppedForward:
        """Check and start one step (as `forward`), to be run by `advance` a few layers (of a piece of its tokens) per
        call; other sessions' steps may run between the calls (hearth/inference/layer_pass.py says why)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        start_pos = as_position(start_pos)
        with self._lock:
            self._check_open()
            run_lo, run_hi = self._validate_sub_range(layers)
            hidden_states = self._validate_hidden_states(hidden_states)
            self._caches.evict_expired()
            session = self._session_for(session_id, start_pos, hidden_states.shape[1], kind, run_lo, run_hi)
            return SteppedForward(session_id=session_id, session=session, hidden_states=hidden_states,
                                  start_pos=start_pos, run_lo=run_lo, run_hi=run_hi, kind=kind,
                                  prompt_tokens=prompt_tokens, stack=self._stack if self._static is None else None)

    def advance(self, step: SteppedForward, max_layers: int | None = None,
                piece_tokens: int | None = None) -> torch.Tensor | None:
        """Run the next `max_layers` layers of a step begun by `begin_forward` (everything when None), in a piece of
        `piece_tokens` of its tokens (all the rest when None; SteppedForward says why); its output once the step has
        run whole, else None. Raises SessionEvictedError when the session was reset or evicted since the last call."""
        if piece_tokens is not None and piece_tokens < 1:
            raise ValueError(f"piece_tokens must be at least 1, got {piece_tokens}")
        with self._lock:
            self._check_still_cached(step)
            if step.stack is None:
                with self._stepping(step), torch.inference_mode():
                    output = self._static.run(step.session.cache, *step.whole_step)
                return self._record_step(step, output)
        # The layers run outside the lock: they touch this session's own cache only (the weights are read-only), so
        # another thread's step of another session may run beside them (a shard's niced prefill thread beside its
        # compute thread, hearth/services/shard/compute.py). A session's own steps come one after another.
        with self._stepping(step), torch.inference_mode():
            output = step.run(max_layers, piece_tokens)
        with self._lock:
            # Reset or evicted meanwhile (budget, or the hop re-opened): its cache is gone, so is this step's work.
            self._check_still_cached(step)
            return self._record_step(step, output)

    def _check_still_cached(self, step: SteppedForward) -> None:
        self._check_open()
        if self._caches.get(step.session_id) is not step.session:
            reason = self._caches.eviction_reason(step.session_id) or "reset or restarted"
            raise SessionEvictedError(f"session {step.session_id!r} was evicted from layers {self.layer_lo}-"
                                      f"{self.layer_hi} ({reason}) in the middle of a step; re-prefill from 0")

    def _record_step(self, step: SteppedForward, output: torch.Tensor | None) -> torch.Tensor | None:
        self._caches.record_use(step.session_id)
        if output is not None:
            self._caches.enforce_budget(keep=step.session_id)
        return output

    @contextlib.contextmanager
    def _stepping(self, step: SteppedForward) -> Iterator[None]:
        try:
            yield
        except BaseException:
            # A half-updated cache would silently corrupt the next step; the caller re-prefills instead.
            with self._lock:
                if self._caches.get(step.session_id) is step.session:
                    self._caches.drop(step.session_id)
            raise

    def step_batch(self, steps: Sequence[BatchRow],
                   layers: tuple[int, int] | None = None) -> list[torch.Tensor | Exception]:
        """One step each (decode, or a short prefill) of several sessions as one batched forward
        (hearth/inference/batched.py), each row under `forward`'s cache rules. Per row in order: its output ``[1, T_i,
        hidden_size]`` or the error that row alone raised (the others still run); when the forward fails, every row's
        cache is dropped with its error.
        """
        with self._lock:
            self._check_open()
            run_lo, run_hi = self._validate_sub_range(layers)
            self._caches.evict_expired()
            outcomes: list[torch.Tensor | Exception | None] = [None] * len(steps)
            ready: list[tuple[int, BatchRow, torch.Tensor, object]] = []
            seen: set[str] = set()
            for index, row in enumerate(steps):
                try:
                    if row.session_id in seen:
                        raise ValueError(f"session {row.session_id!r} appears twice in one batch")
                    hidden_states = self._validate_hidden_states(row.hidden_states)
                    session = self._session_for(row.session_id, as_position(row.start_pos), hidden_states.shape[1],
                                                row.kind, run_lo, run_hi)
                except (ValueError, InferenceError) as error:
                    outcomes[index] = error
                    continue
                seen.add(row.session_id)
                ready.append((index, row, hidden_states, session))
            try:
                with torch.inference_mode():
                    outputs = self._run_rows(ready, run_lo, run_hi)
            except Exception as error:
                for index, row, _, _ in ready:
                    self._caches.drop(row.session_id)
                    outcomes[index] = error
                return outcomes
            for (index, row, _, _), output in zip(ready, outputs, strict=True):
                outcomes[index] = output
                self._caches.record_use(row.session_id)
            if ready:
                self._caches.enforce_budget(keep=ready[-1][1].session_id)
            return outcomes

    def _run_rows(self, ready: list, run_lo: int, run_hi: int) -> list[torch.Tensor]:
        batchable = (self._batched if self._static is None else all(h.shape[1] == 1 for _, _, h, _ in ready)
                     ) and all(row.kind != "replay" for _, row, _, _ in ready)  # replayed queries attend alone
        if len(ready) < 2 or not batchable:
            return [self._run_solo(session.cache, hidden, as_position(row.start_pos), run_lo, run_hi, row.kind,
                                   row.prompt_tokens) for _, row, hidden, session in ready]
        caches = [session.cache for *_, session in ready]
        positions = [as_position(row.start_pos) for _, row, _, _ in ready]
        if self._static is not None:  # its graphs batch one-token steps only
            return self._static.run_batch(caches, torch.cat([hidden for _, _, hidden, _ in ready]), positions,
                                          run_lo, run_hi, extents=[row.prompt_tokens for _, row, _, _ in ready])
        return run_batched_step(stack=self._stack, caches=caches, hidden_states=[h for _, _, h, _ in ready],
                                positions=positions, run_lo=run_lo, run_hi=run_hi, buffers=self._stacking_buffers,
                                extents=[row.prompt_tokens for _, row, _, _ in ready])

    def _run_solo(self, cache, hidden_states: torch.Tensor, start_pos: int, run_lo: int, run_hi: int,
                  kind: StepKind, extent: int | None) -> torch.Tensor:
        if self._static is not None:
            return self._static.run(cache, hidden_states, start_pos, run_lo, run_hi, kind, extent)
        return self._stack.layer_pass(cache, hidden_states, start_pos, run_lo, run_hi, kind == "replay",
                                      extent=extent).run()

    def _session_for(self, session_id: str, start_pos: int, num_tokens: int, kind: str, run_lo: int, run_hi: int):
        """The session a step runs in: a prefill at 0 (re)starts it, any other step continues it (checked)."""
        if kind not in STEP_KINDS:
            raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
        if kind == "prefill" and start_pos == 0:
            self._check_fits(start_pos, num_tokens, run_lo, run_hi, cached_bytes=0)
            return self._caches.start(session_id)
        return self._continuing_session(session_id, start_pos, num_tokens, run_lo, run_hi, kind)

    def _continuing_session(self, session_id: str, start_pos: int, num_tokens: int, run_lo: int, run_hi: int,
                            kind: str):
        """The session a non-initial step continues, checked (it exists, it is at ``start_pos``, it fits)."""
        session = self._caches.get(session_id)
        if session is None and (reason := self._caches.eviction_reason(session_id)) is not None:
            raise SessionEvictedError(f"session {session_id!r} was evicted from layers {self.layer_lo}-"
                                      f"{self.layer_hi} ({reason}); re-prefill from position 0")
        if session is None:
            raise SessionStateError(f"session {session_id!r} has no cache on layers {self.layer_lo}-{self.layer_hi} "
                                    "(never prefilled, reset or evicted); re-prefill from position 0")
        if kind != "decode" and self._prefix_sessions is not None:  # a chain's first step: a prefill or a replay
            self._prefix_sessions.cut_back(session, start_pos, range(self.layer_lo, self.layer_hi + 1))
        self._check_continues(session_id, session.cache, start_pos, run_lo, run_hi)
        self._check_fits(start_pos, num_tokens, run_lo, run_hi, cached_bytes=session.cached_bytes)
        return session

    # ----------------------------------------------------------------- decode paths

    @property
    def graph_captures_total(self) -> int:
        """CUDA graphs captured so far (0 without graphs): per session, batch set and attention width reached."""
        return self._static.graph_captures_total if self._static is not None else 0

    @property
    def lean_decode(self) -> bool:
        """Whether one-token steps run on the lean path (hearth/inference/lean_decode.py), not transformers' modules."""
        with self._lock:
            return self._stack.lean is not None and self._stack.lean.decoder() is not None

    @property
    def graphs_decode(self) -> bool:
        """True when decode steps replay CUDA graphs over static caches."""
        return self._static is not None and self._static.capture_graphs

    # ----------------------------------------------------------------- weights & lifecycle

    @property
    def num_layers(self) -> int:
        """How many layers this runner holds."""
        return self.layer_hi - self.layer_lo + 1

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The loaded layer parameters under their checkpoint names (``model.layers.<i>.…``)."""
        for layer_index, layer in self._stack.layers.items():
            for name, parameter in layer.named_parameters():
                yield f"{self._layer_prefix}{layer_index}.{name}", parameter

    @property
    def weight_bytes(self) -> int:
        """Bytes of the loaded layer weights (what this shard holds in memory besides caches)."""
        return held_tensor_bytes(self._stack.layers.values())

    def close(self) -> None:
        """Free every cache and the weights; later calls raise RunnerClosedError."""
        with self._lock:
            self._caches.drop_all()
            if self._caches.prefixes is not None:
                self._caches.prefixes.clear()
            self._stack = dataclasses.replace(self._stack, layers={}, lean=None)
            self._closed = True

    def __enter__(self) -> LayerRangeRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
