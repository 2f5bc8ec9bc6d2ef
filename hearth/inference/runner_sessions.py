"""RunnerSessions: the sessions a LayerRangeRunner holds, kept prefixes, resets, evictions and their accounting."""

from __future__ import annotations

from collections.abc import Sequence

from .prefix_cache import PrefixCache
from .sessions import EvictedSession


class RunnerSessions:
    """Mixed into LayerRangeRunner: its session caches and kept prefixes, each method under the runner's lock."""

    def attach_prefix(self, session_id: str, block_hashes: Sequence[str], block_tokens: int,
                      layers: tuple[int, int] | None = None, opener: str | None = None) -> int:
        """(Re)start a session holding the longest prefix of the named blocks that sessions of `opener` kept; the
        positions it holds (its first step, a prefill or a replay, may start anywhere up to them). 0 when none is
        kept or prefixes are not kept here."""
        with self._lock:
            self._check_open()
            run_lo, run_hi = self._validate_sub_range(layers)
            if self._prefix_sessions is None:
                self._caches.start(session_id)
                return 0
            return self._prefix_sessions.attach(session_id, block_hashes, block_tokens, run_lo, run_hi, opener)

    def keep_prefix(self, session_id: str, block_hashes: Sequence[str], block_tokens: int,
                    layers: tuple[int, int] | None = None, end_session: bool = True, opener: str | None = None) -> int:
        """Keep the positions of the named blocks a session holds whole as a prefix for later sessions of `opener`,
        ending it (freed as by `reset`) unless `end_session` is False; the positions kept."""
        with self._lock:
            self._check_open()
            run_lo, run_hi = self._validate_sub_range(layers)
            session = self._caches.get(session_id)
            if self._prefix_sessions is None or session is None:
                if end_session:
                    self._caches.drop(session_id)
                return 0
            cached = min(self._cached_length(session.cache, i) for i in range(run_lo, run_hi + 1))
            return self._prefix_sessions.keep(session_id, block_hashes, block_tokens, run_lo, run_hi, cached,
                                              end_session, opener)

    def drop_kept_prefixes(self, opener: str) -> int:
        """Drop every prefix sessions of `opener` kept; the bytes freed."""
        with self._lock:
            return 0 if self._caches.prefixes is None else self._caches.prefixes.drop_opener(opener)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The kept prefixes (None where none are kept); read its counters under no lock, they only grow."""
        return self._caches.prefixes

    def reset(self, session_id: str) -> int:
        """Drop a session's cache (a no-op for an unknown session); returns the bytes freed."""
        with self._lock:
            return self._caches.drop(session_id)

    def evict_expired(self) -> list[EvictedSession]:
        """Drop sessions idle longer than the TTL now (also done at the start of every step)."""
        with self._lock:
            return self._caches.evict_expired()

    def session_bytes(self, session_id: str) -> int:
        """KV-cache bytes held for one session (0 if unknown)."""
        with self._lock:
            return self._caches.session_bytes(session_id)

    @property
    def cache_bytes(self) -> int:
        """KV-cache bytes held for all sessions together."""
        with self._lock:
            return self._caches.total_bytes

    @property
    def cache_budget_bytes(self) -> int:
        return self._caches.budget_bytes

    @property
    def static_session_bytes(self) -> int | None:
        """KV bytes each session's static cache takes here, all at once (None: dynamic caches grow as used)."""
        return None if self._static is None else self._static.cache_bytes_per_session(
            self._kv_bytes_per_token_per_layer, self.num_layers)

    @property
    def evictions_total(self) -> int:
        """Sessions evicted so far (TTL or budget; resets are not evictions)."""
        with self._lock:
            return self._caches.evictions_total

    def session_ids(self) -> list[str]:
        """Live sessions, least recently used first."""
        with self._lock:
            return self._caches.session_ids()

    def cached_tokens(self, session_id: str) -> int:
        """Tokens a session has cached (in the layers it runs; 0 if unknown)."""
        with self._lock:
            session, layers = self._caches.get(session_id), range(self.layer_lo, self.layer_hi + 1)
            return 0 if session is None else max(self._cached_length(session.cache, i) for i in layers)
