"""The router's view of the mesh as SQL over the read model: each shard's state by the router's own rules, and each
layer's live replicas per (model, quantization scheme, weights), shared by the dashboards and `hearth status`.

The rules are hearth/services/orchestrator/router.py's rule 1, in its order: a shard is `live` (routing may use it)
when advertised, not quarantined nor on a node a quarantine holds, not of a member the log shows removed since it
advertised, not expired (`now < expires_at`) and heard from (its newest heartbeat, or its advertisement) at most
`shard_health_timeout_s` before `now`; otherwise its state says which rule left it out (`quarantined`, `node
quarantined`, `member removed`, `expired`, `stale`). `now` is the end of the dashboard's time range held back, as
the router holds it, to the newest sign of life the read model has heard, for at most `silent_log_grace_s`. A
pipeline never mixes schemes or weights, so coverage is counted per (model, scheme, weights): a model can be served
when one such group covers every layer. The two settings are Grafana dashboard constants (ROUTING_VARIABLES, from
[research.distributed_inference]'s defaults); the routing member is read from the log's `member.removed` events,
where the router reads the roster file.
"""

from __future__ import annotations

from hearth.services.common.config import DistributedInferenceSettings

NOW_S = "$__to / 1000"


def age_at_range_end(column: str) -> str:
    """Seconds from the instant in `column` to the end of the time range (NULL where it is NULL). The read model keeps
    only the newest of each thing (a shard's latest heartbeat, a stream's latest event), so in a past range it may be
    after the end: that age is 0 (heard from then or since), never negative."""
    return f"MAX(0, {NOW_S} - {column})"

# The routing settings the SQL needs, as Grafana dashboard variables (`${name}`) with the configuration's defaults:
# a mesh configured otherwise edits the dashboards' constants, and `hearth status` passes its configuration's values.
ROUTING_VARIABLES: dict[str, float] = {
    name: float(DistributedInferenceSettings.model_fields[name].default)
    for name in ("shard_health_timeout_s", "silent_log_grace_s")
}

LIVE = "live"

# `judged.now_s`: router.judged_instant in SQL (newest sign of life: queries.newest_sign_of_life).
JUDGED_NOW_CTE = f"""judged(now_s) AS (
  SELECT MIN({NOW_S}, MAX(COALESCE(heard.newest, {NOW_S}), {NOW_S} - ${{silent_log_grace_s}}))
  FROM (SELECT MAX(instant) AS newest FROM (SELECT MAX(last_seen) AS instant FROM shard_health
                                             UNION ALL SELECT MAX(advertised_at) FROM shards)) AS heard
)"""

# Every shard row with its state (router.not_alive_because, in its order) and its latest heartbeat's figures.
SHARD_STATES_CTE = f"""{JUDGED_NOW_CTE}, shard_states AS (
  SELECT shards.shard_id AS shard_id, shards.model_id AS model_id, shards.weights_sha256 AS weights_sha256,
         shards.quantization AS quantization, shards.node_id AS node_id, shards.layer_lo AS layer_lo,
         shards.layer_hi AS layer_hi, shards.total_layers AS total_layers, shards.dtype AS dtype,
         shards.memory_required_mb AS memory_required_mb, shard_health.last_seen AS last_seen,
         shard_health.active_streams AS active_streams, shard_health.queue_depth AS queue_depth,
         shard_health.p95_latency_ms AS p95_latency_ms, shard_reputation.status AS reputation_status,
         shards.status = 'advertised' AND judged.now_s < shards.expires_at AS listed,
         CASE
           WHEN shards.status <> 'advertised' THEN shards.status
           WHEN shard_reputation.status = 'quarantined' THEN 'quarantined'
           WHEN EXISTS (SELECT 1 FROM shard_reputation AS held
                        WHERE held.node_id = shards.node_id AND held.status = 'quarantined') THEN 'node quarantined'
           WHEN EXISTS (SELECT 1 FROM member_removals AS removal
                        WHERE removal.member = shards.node_id AND removal.removed_at >= shards.advertised_at)
             THEN 'member removed'
           WHEN judged.now_s >= shards.expires_at THEN 'expired'
           WHEN judged.now_s - MAX(shards.advertised_at, COALESCE(shard_health.last_seen, shards.advertised_at))
                > ${{shard_health_timeout_s}} THEN 'stale'
           ELSE '{LIVE}' END AS state
  FROM shards CROSS JOIN judged
       LEFT JOIN shard_health ON shard_health.shard_id = shards.shard_id
       LEFT JOIN shard_reputation ON shard_reputation.shard_id = shards.shard_id
)"""

# Advertised and not expired: what the shard tables list (a stale or held one with its state).
LISTED = "shard_states.listed"

# Every layer of every (model, scheme, weights) some shard still advertises, with how many live shards of that group
# hold it (a recursive CTE enumerates the layers). A group whose shards were all withdrawn is gone from the mesh.
LAYER_REPLICAS_CTE = f"""WITH RECURSIVE {SHARD_STATES_CTE},
shard_groups(model_id, quantization, weights_sha256, total_layers) AS (
  SELECT model_id, quantization, weights_sha256, MAX(total_layers) FROM shard_states
  GROUP BY model_id, quantization, weights_sha256 HAVING MAX(state <> 'withdrawn')
), layers(model_id, quantization, weights_sha256, layer, total_layers) AS (
  SELECT model_id, quantization, weights_sha256, 0, total_layers FROM shard_groups
  UNION ALL
  SELECT model_id, quantization, weights_sha256, layer + 1, total_layers FROM layers WHERE layer + 1 < total_layers
), layer_replicas AS (
  SELECT layers.model_id AS model_id, layers.quantization AS quantization, layers.weights_sha256 AS weights_sha256,
         layers.layer AS layer, COUNT(shard_states.shard_id) AS replicas
  FROM layers LEFT JOIN shard_states
    ON shard_states.model_id = layers.model_id AND shard_states.quantization = layers.quantization
   AND shard_states.weights_sha256 = layers.weights_sha256 AND shard_states.state = '{LIVE}'
   AND layers.layer BETWEEN shard_states.layer_lo AND shard_states.layer_hi
  GROUP BY layers.model_id, layers.quantization, layers.weights_sha256, layers.layer
)"""

# The weights as routing failures name them (their first 12 hex digits).
SHORT_WEIGHTS = "substr({column}, 1, 12)"

MODELS_SQL = f"""{LAYER_REPLICAS_CTE}
SELECT layer_replicas.model_id AS model, layer_replicas.quantization AS quantization,
       {SHORT_WEIGHTS.format(column='layer_replicas.weights_sha256')} AS weights, COUNT(*) AS layers,
       SUM(replicas > 0) AS covered_layers, MIN(replicas) AS min_replicas,
       (SELECT COUNT(*) FROM shard_states WHERE shard_states.model_id = layer_replicas.model_id
          AND shard_states.quantization = layer_replicas.quantization
          AND shard_states.weights_sha256 = layer_replicas.weights_sha256 AND {LISTED}) AS shards_advertised
FROM layer_replicas GROUP BY layer_replicas.model_id, layer_replicas.quantization, layer_replicas.weights_sha256
ORDER BY model, covered_layers DESC, quantization, weights"""

LAYER_REPLICAS_SQL = f"""{LAYER_REPLICAS_CTE}
SELECT model_id || ' ' || quantization || ' ' || {SHORT_WEIGHTS.format(column='weights_sha256')} || ' L' || layer
         AS layer, replicas
FROM layer_replicas ORDER BY model_id, quantization, weights_sha256, layer"""

# A shard's reputation as routing reads it: its own status, or the quarantine of another shard of its node that holds
# it out (worded as hearth/protocol/quarantine.py's node_quarantine_reason).
REPUTATION_OF_SHARD = """CASE WHEN shard_states.reputation_status = 'quarantined' THEN 'quarantined' ELSE COALESCE(
         (SELECT 'node ' || shard_states.node_id || ' quarantined (shard ' || MIN(held.shard_id) || ' mismatched)'
          FROM shard_reputation AS held WHERE held.node_id = shard_states.node_id AND held.status = 'quarantined'),
         shard_states.reputation_status, 'unchecked') END"""

SHARDS_ADVERTISED_SQL = f"""WITH {SHARD_STATES_CTE}
SELECT node_id AS node, model_id AS model, quantization, layer_lo || '-' || layer_hi AS layers, dtype,
       state, {age_at_range_end('last_seen')} AS heartbeat_age_s, p95_latency_ms AS p95_step_ms,
       {REPUTATION_OF_SHARD} AS reputation, memory_required_mb AS memory_mb, active_streams, queue_depth,
       shard_id AS shard, {SHORT_WEIGHTS.format(column='weights_sha256')} AS weights
FROM shard_states WHERE {LISTED}
ORDER BY model_id, quantization, layer_lo, node_id"""

P95_STEP_OF_LIVE_SHARDS_SQL = f"""WITH {SHARD_STATES_CTE}
SELECT node_id || ' ' || layer_lo || '-' || layer_hi || CASE quantization WHEN 'none' THEN '' ELSE ' ' || quantization
       END AS shard, p95_latency_ms AS p95_step_ms
FROM shard_states WHERE state = '{LIVE}' AND p95_latency_ms IS NOT NULL ORDER BY shard"""
