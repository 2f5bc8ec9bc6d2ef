"""Decode steps that Python kernel launches do not bound: each session's KV cache is a static one (fixed addresses,
`max_tokens` positions), prefill runs eagerly, and on a CUDA device a session's decode step is captured once as a
CUDA graph and replayed for every later token.

Why this shape: a decode step of a small range is dozens of tiny kernels, and launching them one by one from Python
costs more than running them. A graph replays them with one launch. A graph fixes every address it touches, so the
inputs are copied into static buffers, the cache is a `StaticCache` (its length counter lives on the device and is
advanced inside the graph), and the attention mask is computed inside the graph from the position buffer (key j is
visible to the query at position p iff j <= p), never from Python values. Only full-attention layers with SDPA are
graphed; other architectures keep the dynamic cache (LayerRangeRunner decides).

Capture writes nothing: before capturing, one warm-up step runs on a side stream (so that lazily created library
state exists) and its cache writes are undone by resetting the length counters; the replay that follows rewrites
the same slot. Graphs are kept per cache object (weakly): an evicted or reset session frees its graphs with it.

Continuous batching over static caches (`run_batch`): the one-token steps of several sessions run as one forward,
each row appending to its own cache at its own length counter, the layer attending every row's keys stacked and masked
by that row's position. A row that is a prompt's one-token chunk rotates as the whole prompt (Hearth-Prompt-Tokens,
as in a solo step: LongRoPE picks its factors by that length), eagerly. On a GPU a batch is graphed too, one graph
per set of sessions (and layer range): a set seen for the first time steps its sessions one by one through their own
graphs, as before; from its `batch_capture_after_sightings`-th sighting on it is captured and replayed. Why not
capture every batch at once: the batcher's groups change as sessions join, leave and drift apart, and a capture costs
about two eager steps, while a set that keeps decoding together repeats for hundreds of tokens.

A graph has fixed shapes, so it attends a fixed number of each row's key positions: the power of two that covers its
rows (`graph_width`, at least `min_graph_width_tokens`), and a session or set crossing one is captured again (a few
captures in a session's life). Attending all `max_tokens` instead would cost most of a graphed step at long caches
(the layers repeat grouped-query keys and stack rows over every attended position; BENCHMARKS.md, "On a GPU"). Eager
steps (prefill, the CPU) attend exactly the positions they hold.
A graph holds no reference to its sessions' caches; when any of them is freed, the graph goes with it (addresses
would dangle).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, StaticCache

from .architectures import FULL_ATTENTION
from .batched import update_rows
from .layer_call import longer_extent, position_embeddings_by_type, run_decoder_layer
from .errors import SessionTooLargeError
from .prefix_cache import CacheLengths
from .row_attention import SDPA_IMPLEMENTATIONS


def static_decode_supported(config: PretrainedConfig, attention_types: list[str]) -> bool:
    """True when every layer attends fully through SDPA (the masks built here are SDPA's boolean ones) and the RoPE
    is no `dynamic` one (its frequencies change on the host as a session grows, which a captured graph would not)."""
    return all(kind == FULL_ATTENTION for kind in attention_types) and getattr(
        config, "_attn_implementation", None) in SDPA_IMPLEMENTATIONS and not any(
        "dynamic" in str(kind) for kind in _rope_types(getattr(config, "rope_parameters", None)))


def _rope_types(rope_parameters) -> list[object]:
    """The rope_type of a config's rope_parameters, or of each of its per-layer-type parameters."""
    if not isinstance(rope_parameters, dict):
        return []
    if "rope_type" in rope_parameters:
        return [rope_parameters["rope_type"]]
    return [value.get("rope_type") for value in rope_parameters.values() if isinstance(value, dict)]


# The fewest key positions a graphed decode step attends: each graph attends the power of two of positions that
# covers its rows (graph_width), so a step at position 70 reads 128 positions of its cache, not all max_tokens.
min_graph_width_tokens = 128
# How often a set of sessions must arrive as one batch before its batched step is captured (see the module docstring).
batch_capture_after_sightings = 2
# Batched graphs kept at most: capturing one more drops the oldest (its set is captured again if it comes back).
max_batch_graphs = 16
# The sightings remembered at most before the count starts over (sets that never repeat must not pile up).
max_batch_sightings = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    position_ids: torch.Tensor
    output: torch.Tensor


class StaticDecoder:
    """Runs steps of sessions whose caches it made (`new_cache`); graphs decode steps when `capture_graphs`."""

    def __init__(self, *, config: PretrainedConfig, layers: dict[int, nn.Module], rotary_embedding: nn.Module,
                 max_tokens: int, device: torch.device, capture_graphs: bool) -> None:
        self.config = config
        self.max_tokens = max_tokens
        self.device = device
        self.capture_graphs = capture_graphs and device.type == "cuda"
        self._layers = layers
        self._rotary_embedding = rotary_embedding
        self._key_positions = torch.arange(max_tokens, device=device)
        # Tokens cached per layer, kept in Python: asking a StaticLayer would read its device counter (a sync).
        self._lengths: weakref.WeakKeyDictionary[StaticCache, dict[int, int]] = weakref.WeakKeyDictionary()
        self._graphs: weakref.WeakKeyDictionary[StaticCache, dict[tuple[int, int], _Graph]] = (
            weakref.WeakKeyDictionary())
        self._pool = _GraphPool()
        self._batch_graphs: dict[tuple, _Graph] = {}
        self._batch_sightings: dict[tuple, int] = {}
        self.batched_steps_total = 0
        self.graph_captures_total = 0

    def new_cache(self) -> StaticCache:
        cache = StaticCache(config=self.config, max_cache_len=self.max_tokens)
        self._lengths[cache] = {}
        return cache

    def owns(self, cache) -> bool:
        return cache in self._lengths

    def cached_tokens(self, cache: StaticCache, layer_index: int) -> int:
        return self._lengths[cache].get(layer_index, 0)

    def set_cached_tokens(self, cache: StaticCache, layers: range, tokens: int) -> None:
        """Set the positions `layers` of `cache` hold (a kept prefix filled in, or cut back to): the device counters
        the next update writes at, and this decoder's own count."""
        lengths = self._lengths[cache]
        for layer_index in layers:
            layer = cache.layers[layer_index]
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(tokens)
            lengths[layer_index] = tokens

    def cache_bytes_per_session(self, kv_bytes_per_token_per_layer: int, num_layers: int) -> int:
        return self.max_tokens * kv_bytes_per_token_per_layer * num_layers

    def check_room(self, start_pos: int, num_tokens: int) -> None:
        """SessionTooLargeError when a step of `num_tokens` at `start_pos` would not fit a static cache."""
        if start_pos + num_tokens > self.max_tokens:
            raise SessionTooLargeError(f"position {start_pos + num_tokens} is beyond this runner's static KV cache of "
                                       f"{self.max_tokens} positions")

    def graph_width(self, tokens: int) -> int:
        """The key positions a graph attends for steps whose rows hold at most `tokens` tokens: the next power of two
        (at least `min_graph_width_tokens`, at most `max_tokens`)."""
        return min(self.max_tokens, max(min_graph_width_tokens, 1 << (tokens - 1).bit_length()))

    def run(self, cache: StaticCache, hidden: torch.Tensor, start_pos: int, run_lo: int, run_hi: int,
            kind: str, extent: int | None = None) -> torch.Tensor:
        """One step (rotated as a sequence of `extent` tokens where given: layer_call). A replayed graph's output is a
        static buffer in the graphs' shared memory pool: valid only until the next replay of any of this decoder's
        graphs (copy it out first, as `to_host` does)."""
        num_tokens = hidden.shape[1]
        self.check_room(start_pos, num_tokens)
        if kind == "decode" and num_tokens == 1 and self.capture_graphs:
            graphs = self._graphs.setdefault(cache, {})
            key = (run_lo, run_hi, self.graph_width(start_pos + 1))
            entry = graphs.get(key)
            if entry is None:
                entry = graphs[key] = self._capture([cache], hidden, [start_pos], key[2], run_lo, run_hi)
            output = self._replay(entry, hidden, [start_pos])
        else:
            position_ids = torch.arange(start_pos, start_pos + num_tokens, device=self.device).unsqueeze(0)
            output = self._body([cache], hidden, position_ids, start_pos + num_tokens, run_lo, run_hi,
                                [longer_extent(extent, start_pos, num_tokens)], as_decoded=kind == "replay")
        lengths = self._lengths[cache]
        for layer_index in range(run_lo, run_hi + 1):
            lengths[layer_index] = start_pos + num_tokens
        return output

    def run_batch(self, caches: Sequence[StaticCache], hidden: torch.Tensor, positions: Sequence[int], run_lo: int,
                  run_hi: int, extents: Sequence[int | None] | None = None) -> list[torch.Tensor]:
        """One step of one token each (``hidden`` ``[B, 1, hidden]``) of several sessions: row i at positions[i]
        of caches[i], rotated as a sequence of extents[i] tokens where given (a prompt's one-token chunk told the
        prompt's length: layer_call); each row's output ``[1, 1, hidden]``, valid as `run`'s until the next replay."""
        for position in positions:
            self.check_room(position, 1)
        longer = [longer_extent(extent, position, 1)
                  for extent, position in zip(extents or [None] * len(positions), positions, strict=True)]
        # A graph fixes its rows' rotary lengths (and steps each row as a decode step): a row told a longer prompt's
        # length runs eagerly.
        if self.capture_graphs and all(extent is None for extent in longer):
            width = self.graph_width(max(positions) + 1)
            key = (tuple(id(cache) for cache in caches), run_lo, run_hi, width)
            entry = self._batch_graphs.get(key)
            if entry is None and self._sighted(key) < batch_capture_after_sightings:
                # Each row's output copied out of the graph pool before the next row's replay: the graphs share
                # one pool, so a replay may write where another graph's output lies (issue 14's first GPU run:
                # a Llama-3-8B shard whose batches kept changing under KV evictions sent NaN to the next hop).
                return [self.run(cache, hidden[row:row + 1], position, run_lo, run_hi, "decode").clone()
                        for row, (cache, position) in enumerate(zip(caches, positions, strict=True))]
            if entry is None:
                entry = self._capture_batch(key, caches, hidden, positions, width, run_lo, run_hi)
            output = self._replay(entry, hidden, positions)
        else:
            position_ids = torch.tensor(list(positions), dtype=torch.long, device=self.device).view(-1, 1)
            output = self._body(caches, hidden, position_ids, max(positions) + 1, run_lo, run_hi, longer)
        self.batched_steps_total += 1
        for cache, position in zip(caches, positions, strict=True):
            lengths = self._lengths[cache]
            for layer_index in range(run_lo, run_hi + 1):
                lengths[layer_index] = position + 1
        return list(output.split(1))

    def _sighted(self, key: tuple) -> int:
        if len(self._batch_sightings) >= max_batch_sightings:
            self._batch_sightings.clear()
        self._batch_sightings[key] = self._batch_sightings.get(key, 0) + 1
        return self._batch_sightings[key]

    def _body(self, caches: Sequence[StaticCache], hidden: torch.Tensor, position_ids: torch.Tensor, width: int,
              run_lo: int, run_hi: int, extents: Sequence[int | None] | None = None, as_decoded: bool = False,
              ) -> torch.Tensor:
        """The layers for row i's ``hidden[i]`` at ``position_ids[i]`` over caches[i] (rotated as extents[i] tokens
        where given), attending each row's first `width` positions; no host synchronisation (capturable when `width`
        is fixed)."""
        position_embeddings = position_embeddings_by_type(self._rotary_embedding, hidden, position_ids,
                                                          [FULL_ATTENTION], extents, as_decoded)[FULL_ATTENTION]
        # [B, 1, T, width], True where the key's position is at most the query's.
        mask = (self._key_positions[:width].view(1, 1, -1) <= position_ids.unsqueeze(-1)).unsqueeze(1)
        rows = _StaticRows(caches, width)
        for layer_index in range(run_lo, run_hi + 1):
            hidden = run_decoder_layer(self._layers[layer_index], hidden, attention_mask=mask,
                                       position_ids=position_ids, cache=rows, position_embeddings=position_embeddings)
        return hidden

    def _capture_batch(self, key: tuple, caches: Sequence[StaticCache], hidden: torch.Tensor,
                       positions: Sequence[int], width: int, run_lo: int, run_hi: int) -> _Graph:
        entry = self._capture(caches, hidden, positions, width, run_lo, run_hi)
        if len(self._batch_graphs) >= max_batch_graphs:
            self._batch_graphs.pop(next(iter(self._batch_graphs)))
        self._batch_graphs[key] = entry
        self._batch_sightings.pop(key, None)
        for cache in caches:
            weakref.finalize(cache, self._batch_graphs.pop, key, None)
        return entry

    def _replay(self, entry: _Graph, hidden: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        entry.hidden.copy_(hidden, non_blocking=True)
        if len(positions) == 1:  # a fill takes its value as a kernel argument: no host-to-device copy
            entry.position_ids.fill_(positions[0])
        else:
            entry.position_ids.copy_(torch.tensor(list(positions), dtype=torch.long).view(-1, 1))
        entry.graph.replay()
        return entry.output

    def _capture(self, caches: Sequence[StaticCache], hidden: torch.Tensor, positions: Sequence[int], width: int,
                 run_lo: int, run_hi: int) -> _Graph:
        """The decode step of rows at `positions` of `caches` (one token each) attending `width` positions, captured
        as a graph over static copies of its inputs."""
        static_hidden = hidden.clone()
        position_ids = torch.tensor(list(positions), dtype=torch.long, device=self.device).view(-1, 1)
        counters = [(cache.layers[index].cumulative_length, position)
                    for cache, position in zip(caches, positions, strict=True) for index in range(run_lo, run_hi + 1)]
        graph, output = self._capture_graph(
            lambda: self._body(caches, static_hidden, position_ids, width, run_lo, run_hi), counters)
        return _Graph(graph, static_hidden, position_ids, output)

    def _capture_graph(self, body: Callable[[], torch.Tensor], counters: list[tuple[torch.Tensor, int]]
                       ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`body` (a step over static caches) captured as a graph, and the graph's output buffer. `counters`: the
        caches' length counters with the position each had before the step."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()
            for counter, position in counters:  # undo the warm-up's step: the replay writes the same slots again
                counter.fill_(position)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with _cyclic_gc_paused(), torch.cuda.graph(graph, pool=self._pool.for_capture()):
            output = body()
        self._pool.captured(graph)
        self.graph_captures_total += 1
        return graph, output


class StaticCacheLengths(CacheLengths):
    """Kept prefixes' view of static caches: their tensors span every position, the decoder counts the filled ones."""

    def __init__(self, decoder: StaticDecoder) -> None:
        self._decoder = decoder

    def held(self, cache, layer_index: int) -> int | None:
        return self._decoder.cached_tokens(cache, layer_index) or None

    def cut(self, cache, layers: range, tokens: int) -> None:
        held = [index for index in layers if self._decoder.cached_tokens(cache, index) > tokens]
        if held:
            self._decoder.set_cached_tokens(cache, range(min(held), max(held) + 1), tokens)

    def filled(self, cache, layers: range, tokens: int) -> None:
        self._decoder.set_cached_tokens(cache, layers, tokens)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a capture: a collection inside it may free an evicted session's
    cache, and with it that cache's graphs, and destroying a graph while a stream captures invalidates the capture
    (CUDA answers `operation not permitted when stream is capturing`, then cudaErrorStreamCaptureInvalidated; it
    happens when batches change under KV evictions). What it would have freed is freed at the next collection."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _GraphPool:
    """The memory pool a decoder's graphs share, renewed once none of its graphs is alive: PyTorch frees a private
    pool with the last graph captured into it, and capturing into the freed pool's handle fails an internal
    allocator assert (as when a mesh's second request captures after the first's sessions, and their graphs, are
    gone)."""

    def __init__(self) -> None:
        self._handle = None
        self._live_graphs = 0

    def for_capture(self):
        if self._live_graphs == 0:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def captured(self, graph: torch.cuda.CUDAGraph) -> None:
        self._live_graphs += 1
        weakref.finalize(graph, self._graph_freed)

    def _graph_freed(self) -> None:
        self._live_graphs -= 1


class _StaticRows:
    """A layer's KV cache argument for a batch of sessions with static caches: row i's new key/value go into
    caches[i] at that cache's own length counter, and the layer attends every row's first `width` positions."""

    def __init__(self, caches: Sequence[StaticCache], width: int) -> None:
        self.caches = list(caches)
        self.width = width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update_rows(self.caches, key_states.split(1), value_states.split(1), layer_idx, *args, **kwargs)
        if len(keys) == 1:  # one session: views of its cache, no copy
            return keys[0][:, :, :self.width], values[0][:, :, :self.width]
        return (torch.cat([row_keys[:, :, :self.width] for row_keys in keys]),
                torch.cat([row_values[:, :, :self.width] for row_values in values]))
