"""Per-session KV caches of one layer range: byte accounting, idle TTL and LRU eviction under a budget."""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig

from .prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

EVICT_REASON_TTL = "ttl"
EVICT_REASON_BUDGET = "budget"
# Evicted sessions remembered, so that their next step can say "evicted" rather than "unknown".
remembered_evictions = 4096


@dataclass(frozen=True)
class EvictedSession:
    """A session whose cache was dropped, why, and how many bytes that freed."""

    session_id: str
    reason: str
    freed_bytes: int


@dataclass
class _Session:
    cache: DynamicCache
    last_used_s: float
    cached_bytes: int = 0
    # Positions copied in from a kept prefix and not stepped on yet: its first step may start anywhere up to them.
    attached_tokens: int = 0


def kv_cache_bytes(cache: DynamicCache, layer_indices: Iterable[int]) -> int:
    """Bytes of the keys and values the given cache layers hold (a tensor shared by layers once): the positions
    cached, or a static cache's every position; not the room a growing layer keeps for its next positions
    (hearth/inference/kv_growth.py: at most `KV_GROWTH_POSITIONS` a layer)."""
    seen_tensors: set[int] = set()
    total = 0
    for layer_index in layer_indices:
        layer = cache.layers[layer_index]
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or tensor.data_ptr() in seen_tensors:
                continue
            seen_tensors.add(tensor.data_ptr())
            total += tensor.nbytes
    return total


class SessionCaches:
    """The caches of every live session of one runner; not thread-safe on its own (the runner locks).

    ``on_evict`` is called (under the runner's lock) for every TTL or budget eviction; keep it quick.

    Sessions are kept in least-recently-used order. ``evict_expired`` drops sessions idle longer than
    ``ttl_s``; ``enforce_budget`` drops the least recently used ones until the total fits ``budget_bytes``.
    """

    def __init__(
        self,
        make_cache: Callable[[], DynamicCache],
        layer_indices: range,
        *,
        budget_bytes: int,
        ttl_s: float,
        clock: Callable[[], float],
        on_evict: Callable[[EvictedSession], None] | None = None,
        prefixes: PrefixCache | None = None,
        session_reserve_bytes: int = 0,
    ):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._make_cache = make_cache
        self._layer_indices = layer_indices
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_evict = on_evict
        # Kept prefixes share the budget and give way first: a live session's cache outranks a maybe-reused one.
        self.prefixes = prefixes
        # What a new session takes at once before its first step is measured (a static cache's every position):
        # kept prefixes make room for it first, so the caches never hold more than the budget even for a moment.
        self.session_reserve_bytes = session_reserve_bytes
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()
        self.evictions_total = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def session_ids(self) -> list[str]:
        """Live sessions, least recently used first."""
        return list(self._sessions)

    @property
    def total_bytes(self) -> int:
        return sum(session.cached_bytes for session in self._sessions.values())

    def session_bytes(self, session_id: str) -> int:
        """Cached bytes of one session (0 when it does not exist)."""
        session = self._sessions.get(session_id)
        return session.cached_bytes if session else 0

    def get(self, session_id: str) -> _Session | None:
        return self._sessions.get(session_id)

    def eviction_reason(self, session_id: str) -> str | None:
        """Why a session that is gone was evicted (`ttl` or `budget`), or None when it was not evicted."""
        return self._evicted.get(session_id)

    def start(self, session_id: str) -> _Session:
        """A fresh, empty cache for the session, replacing any older one."""
        self.drop(session_id)
        self._evicted.pop(session_id, None)
        self._evict_prefixes_beyond(self.budget_bytes - self.session_reserve_bytes)
        session = _Session(cache=self._make_cache(), last_used_s=self._clock())
        self._sessions[session_id] = session
        return session

    def record_use(self, session_id: str) -> None:
        """Re-measure a session after a step and mark it most recently used."""
        session = self._sessions[session_id]
        session.cached_bytes = kv_cache_bytes(session.cache, self._layer_indices)
        session.last_used_s = self._clock()
        session.attached_tokens = 0
        self._sessions.move_to_end(session_id)

    def pop(self, session_id: str) -> _Session | None:
        """Take a session out (to keep its cache as a prefix); None when it does not exist."""
        return self._sessions.pop(session_id, None)

    def drop(self, session_id: str) -> int:
        """Forget a session at the caller's request (no eviction callback); returns the bytes it held."""
        session = self._sessions.pop(session_id, None)
        return session.cached_bytes if session else 0

    def drop_all(self) -> int:
        """Forget every session; returns the bytes they held."""
        return sum(self.drop(session_id) for session_id in list(self._sessions))

    def evict_expired(self) -> list[EvictedSession]:
        """Drop every session idle for longer than ttl_s."""
        deadline = self._clock() - self.ttl_s
        expired = [sid for sid, session in self._sessions.items() if session.last_used_s < deadline]
        if self.prefixes is not None:
            self.prefixes.evict_expired()
        return [self._evict(session_id, EVICT_REASON_TTL) for session_id in expired]

    def enforce_budget(self, keep: str | None = None) -> list[EvictedSession]:
        """Drop least recently used sessions (never ``keep``) until the total fits the budget."""
        evicted = []
        self._evict_prefixes_beyond(self.budget_bytes)
        for session_id in list(self._sessions):
            if self.total_bytes <= self.budget_bytes:
                break
            if session_id != keep:
                evicted.append(self._evict(session_id, EVICT_REASON_BUDGET))
        return evicted

    def _evict_prefixes_beyond(self, budget_bytes: int) -> None:
        """Drop the least recently used kept prefixes until they and the sessions fit `budget_bytes`."""
        prefixes = self.prefixes
        while prefixes is not None and len(prefixes) and self.total_bytes + prefixes.total_bytes > budget_bytes:
            prefixes.evict_oldest()

    def _evict(self, session_id: str, reason: str) -> EvictedSession:
        freed = self.drop(session_id)
        self.evictions_total += 1
        self._evicted[session_id] = reason
        while len(self._evicted) > remembered_evictions:
            self._evicted.popitem(last=False)
        event = EvictedSession(session_id, reason, freed)
        self._notify(event)
        return event

    def _notify(self, event: EvictedSession) -> None:
        logger.debug(
            "kv cache evicted: session=%s reason=%s bytes=%d",
            event.session_id,
            event.reason,
            event.freed_bytes,
        )
        if self._on_evict is not None:
            self._on_evict(event)


def kv_bytes_per_token_per_layer(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in one layer (keys and values of every KV head)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * kv_heads * head_dim * dtype.itemsize


def as_position(start_pos) -> int:
    """``start_pos`` as a plain int (numpy and torch integers accepted), or ValueError."""
    if isinstance(start_pos, bool):
        raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
    try:
        position = operator.index(start_pos)
    except TypeError:
        raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}") from None
    if position < 0:
        raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
    return position

