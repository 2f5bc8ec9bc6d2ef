"""The KV budget and idle TTL a test's runner gets unless the test is about them: a shard's configured defaults
(`[shard] kv_cache_budget_mb` and `eviction_idle_s`), which `load_layer_range` and `load_full` require."""

from __future__ import annotations

from hearth.services.common.config_processes import ShardSettings

_shard_defaults = ShardSettings()
KV_BUDGET_BYTES = _shard_defaults.kv_cache_budget_bytes
SESSION_TTL_S = _shard_defaults.eviction_idle_s
# Spread into a call: `load_layer_range(path, 0, 5, **RUNNER_KV_LIMITS)`.
RUNNER_KV_LIMITS = {"cache_budget_bytes": KV_BUDGET_BYTES, "session_ttl_s": SESSION_TTL_S}
