"""The four hearth dashboards (Mesh, Pipelines, Shard hosts, Event log): every panel's SQL or PromQL.

SQL panels read the read model (hearth/readmodels/tables.py: instants are INTEGER epoch seconds, which the SQLite
plugin turns into times itself) and are preferred wherever the read model holds the data; "now" is the end of
the dashboard's time range (`$__to / 1000`), so a panel shows the mesh as it was at the end of the range. The read
model keeps only the newest of each shard's heartbeats and each stream's position, so an age measured to a past
range's end is 0 where the newest came since, never negative (routing_sql.age_at_range_end). Which
shards are live and which layers they cover is the router's own rule (hearth/services/dashboards/routing_sql.py).
PromQL panels use only the metric names agreed with the metrics side (orchestrator, shard and projector
metrics), for what only live processes know (calls in flight, step compute histograms, KV cache, lag).

Not shown yet: a shard's device (advertisements do not carry it; the shard tables show dtype and the
memory its range needs) and the many-users issue's request queue, which gets a SQL panel on Pipelines once
its table exists (until then `hearth_queued_requests` is drawn beside calls in flight).
"""

from __future__ import annotations

from hearth.services.dashboards.model import Dashboard, PromPanel, PromTarget, SqlPanel
from hearth.services.dashboards.routing_sql import (LAYER_REPLICAS_SQL, MODELS_SQL, P95_STEP_OF_LIVE_SHARDS_SQL,
                                                    SHARDS_ADVERTISED_SQL, age_at_range_end)


def in_range(column: str) -> str:
    """The dashboard's time range on an epoch-seconds column. Not the plugin's `$__timeFilter(column)`: that
    wraps the column in CAST(CASE ...), which no index can serve; this BETWEEN uses the read model's indexes
    (scripts/bench_dashboard_queries.py). `$__from`/`$__to` are epoch milliseconds, replaced by Grafana."""
    return f"{column} BETWEEN $__from / 1000 AND $__to / 1000"


# When a call counts (its CALL_AT): when its pipeline was built or, for a call that never got one (refused at routing,
# then aborted or fallen back to local: no constructed_at), when it ended or last changed, so the calls the mesh
# could not route are not missing from the panels that count calls: COALESCE(constructed_at, finished_at, updated_at).
# CALL_AT in the dashboard's range, as two ranges the constructed_at index serves (SQLite's OR by union).
CALLS_IN_RANGE = (f"({in_range('constructed_at')} OR (constructed_at IS NULL AND "
                  f"{in_range('COALESCE(finished_at, updated_at)')}))")


def calls_per_bucket(label: str, condition: str = "1", *, bucket_s: int = 60, counted: str = "COUNT(*)") -> str:
    """(time, label, calls): `counted` over the calls meeting `condition` per `bucket_s` seconds of CALL_AT in the
    dashboard's range, by `label` (an expression on pipelines' columns). Two branches, so the routed calls, nearly
    all, are counted from an index alone; the unrouted ones are looked up by their NULL constructed_at."""
    return f"""SELECT time, label, SUM(calls) AS calls FROM (
  SELECT $__unixEpochGroupSeconds(constructed_at, {bucket_s}) AS time, {label} AS label, {counted} AS calls
  FROM pipelines WHERE {in_range('constructed_at')} AND {condition} GROUP BY 1, 2
  UNION ALL
  SELECT $__unixEpochGroupSeconds(ended_at, {bucket_s}) AS time, {label} AS label, {counted} AS calls FROM (
    SELECT COALESCE(finished_at, updated_at) AS ended_at, * FROM pipelines WHERE constructed_at IS NULL AND {condition})
  WHERE {in_range('ended_at')} GROUP BY 1, 2
) GROUP BY 1, 2"""


def node_of_shard_sql(column: str) -> str:
    """hearth/protocol/subjects.py's node_of_shard in SQL: what follows the shard id's last `@` (the id itself when it
    has none), for the shards whose rows the retention pruned while their totals stay."""
    return f"substr({column}, length(rtrim({column}, replace({column}, '@', ''))) + 1)"


# Every shard verification has spoken about (hearth/readmodels/reputation.py), quarantined ones first.
REPUTATION_SQL = """SELECT COALESCE(node_id, '') AS node, shard_id AS shard, status, checks, verified_positions,
       mismatches, disputes, datetime(status_since, 'unixepoch') AS since, COALESCE(status_reason, '') AS reason
FROM shard_reputation ORDER BY status = 'quarantined' DESC, mismatches DESC, disputes DESC, shard"""

CALLS_BY_OUTCOME_SQL = f"""SELECT time, label AS outcome, calls FROM ({calls_per_bucket('status')}) ORDER BY 1, 2"""

# The calls checked at all (verify not `none`; not `unrecorded`, whose outcome is unknown), so an hour of checked calls
# none of which was unmet shows 0; the (verification, constructed_at, model_id) index covers it.
CHECKED_CALL = "verification IN ('met', 'unmet')"
UNMET_VERIFICATION_SQL = f"""SELECT time, label AS model, calls AS unmet_calls FROM ({calls_per_bucket(
    "COALESCE(model_id, '')", CHECKED_CALL, bucket_s=3600, counted="SUM(verification = 'unmet')")}) ORDER BY 1, 2"""


def minute_percentiles_sql(prefix: str, unit_suffix: str = "") -> str:
    """p50 and p95 per minute from pipeline_minutes (kept by the projection: hearth/readmodels/pipeline_minutes.py)."""
    return f"""SELECT minute AS time, {prefix}_p50{unit_suffix} AS p50, {prefix}_p95{unit_suffix} AS p95
FROM pipeline_minutes WHERE {in_range('minute')} AND {prefix}_p50{unit_suffix} IS NOT NULL ORDER BY minute"""


def histogram_p(quantile: float, metric: str, by: str = "") -> str:
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({labels}) (rate({metric}_bucket[1m])))"


MESH = Dashboard(
    uid="hearth-mesh",
    title="hearth / Mesh",
    description="Which models the mesh can serve: every layer's routable replicas, and each shard online.",
    panels=(
        SqlPanel(
            "Models", "table", MODELS_SQL,
            ("model", "quantization", "weights", "layers", "covered_layers", "min_replicas", "shards_advertised"),
            "One row per model, quantization scheme and weights (a pipeline never mixes them): the model can be "
            "served in that scheme when covered_layers = layers; min_replicas is its weakest layer. Replicas count "
            "the live shards, those routing may use (see Shards advertised); shards_advertised counts every "
            "advertised one whose advertisement has not expired.",
        ),
        SqlPanel(
            "Live replicas per layer", "barchart", LAYER_REPLICAS_SQL, ("layer", "replicas"),
            "Per model, quantization scheme and weights (12 hex digits): 0: that layer, and the model in that "
            "scheme, cannot be served; 1: no failover possible. Only live shards count.",
        ),
        SqlPanel(
            "Shards advertised", "table", SHARDS_ADVERTISED_SQL,
            ("node", "quantization", "layers", "state", "heartbeat_age_s", "memory_mb", "p95_step_ms",
             "reputation"),
            "Every shard whose advertisement has not expired, with its state by the router's rule: live (routing "
            "may use it), stale (not heard from for over shard_health_timeout_s), quarantined, node quarantined "
            "or member removed. heartbeat_age_s: seconds from its newest heartbeat to the end of the time range; 0 "
            "when that heartbeat came at or after the end (the read model keeps only the newest, so a past range "
            "shows 0 for a shard heard from since); empty before its first heartbeat (the advertisement counts). "
            "The dashboard's constants shard_health_timeout_s and silent_log_grace_s must be the orchestrators' "
            "[research.distributed_inference] values. memory_mb is what the range needs (from its advertisement); "
            "the device is not advertised yet.",
        ),
        PromPanel(
            "KV cache by shard", (PromTarget("sum by (shard_id) (hearth_shard_kv_cache_bytes)", "{{shard_id}}"),),
            "Memory held by the sessions' key/value caches.", unit="bytes",
        ),
        PromPanel(
            "Active sessions by shard",
            (PromTarget("sum by (shard_id) (hearth_shard_active_sessions)", "{{shard_id}}"),),
        ),
        PromPanel(
            "Kept-prefix hit rate by shard",
            (PromTarget('sum by (shard_id) (rate(hearth_shard_prefix_lookups_total{outcome="hit"}[5m])) / '
                        "sum by (shard_id) (rate(hearth_shard_prefix_lookups_total[5m]))", "{{shard_id}}"),),
            "Hops opened naming a call's blocks that found some kept from earlier calls (conversations, shared "
            "system prompts): those positions are not prefilled again.", unit="percentunit",
        ),
    ),
)

PIPELINES = Dashboard(
    uid="hearth-pipelines",
    title="hearth / Pipelines",
    description="Chat calls: how they end, how fast, what failed over or fell back.",
    panels=(
        SqlPanel(
            "Calls per minute by outcome", "timeseries", CALLS_BY_OUTCOME_SQL, ("time", "outcome", "calls"),
            "Calls by the minute their pipeline was built, or, for a call no chain could be built for (refused "
            "at routing, then aborted or fallen back to local), the minute it ended; outcome is the pipeline's "
            "status (completed, aborted, fallback_local, or still streaming).", bars=True,
        ),
        SqlPanel(
            "Time to first token p50 / p95", "timeseries", minute_percentiles_sql("ttft", "_ms"),
            ("time", "p50", "p95"), "Nearest-rank percentiles of the calls started in each minute.", unit="ms",
        ),
        SqlPanel(
            "Decode tokens/s p50 / p95", "timeseries",
            minute_percentiles_sql("tokens_per_second"),
            ("time", "p50", "p95"), "Completed calls started in each minute, nearest rank.",
        ),
        SqlPanel(
            "Failovers and fallbacks per minute", "timeseries",
            f"""SELECT $__unixEpochGroupSeconds(occurred_at, 60) AS time, 'failover' AS kind, COUNT(*) AS events
FROM failovers WHERE {in_range('occurred_at')} GROUP BY 1
UNION ALL
SELECT time, label AS kind, calls AS events FROM ({calls_per_bucket("'fallback_local'", 'fell_back_to_local = 1')})
ORDER BY time""",
            ("time", "kind", "events"),
            "Failovers by the minute each happened (failovers); calls that fell back to local by their minute as "
            "in Calls per minute by outcome (the read model keeps no time of the fallback itself).", bars=True,
        ),
        SqlPanel(
            "Calls per hour whose verification was unmet, by model", "timeseries", UNMET_VERIFICATION_SQL,
            ("time", "model", "unmet_calls"),
            "Completed calls whose hops' work was not all checked as their verify level asked (pipeline.completed's "
            "verification unmet: no other replica to check a hop, say), by the hour counted as in Calls per minute "
            "by outcome; 0 in an hour of checked calls that all met it. Calls at verify none are not counted; "
            "model is empty for a call whose pipeline.constructed aged out of the log.", bars=True,
        ),
        SqlPanel(
            "Aborts by code", "barchart",
            f"""SELECT error_code AS code, COUNT(*) AS aborts FROM pipelines
WHERE status = 'aborted' AND {CALLS_IN_RANGE} GROUP BY error_code ORDER BY aborts DESC, code""",
            ("code", "aborts"), "Calls counted as in Calls per minute by outcome, so those refused at routing "
            "(shard_unavailable, weights_mismatch) are here too.",
        ),
        PromPanel(
            "Calls in flight and queued",
            (PromTarget("sum(hearth_calls_in_flight)", "in flight"),
             PromTarget("sum(hearth_queued_requests)", "queued")),
            "The request queue of the many-users issue gets its own read-model panel once it is projected.",
        ),
        PromPanel(
            "Requests per second by code",
            (PromTarget("sum by (code) (rate(hearth_requests_total[1m]))", "{{code}}"),), unit="reqps",
        ),
        PromPanel(
            "First token, construction p95 and decode p50 (live)",
            (PromTarget(histogram_p(0.95, "hearth_first_token_seconds"), "first token p95 (s)"),
             PromTarget(histogram_p(0.95, "hearth_pipeline_construct_seconds"), "construction p95 (s)"),
             PromTarget(histogram_p(0.5, "hearth_decode_tokens_per_second"), "decode tokens/s p50")),
        ),
        PromPanel(
            "The orchestrator's turn and head step p95 (live)",
            (PromTarget(histogram_p(0.95, "hearth_orchestrator_turn_seconds"), "turn p95 (s)"),
             PromTarget(histogram_p(0.95, "hearth_head_step_seconds"), "head step p95 (s)")),
            "The orchestrator's share of a decode token: from a step's output reaching it to the next step sent; "
            "the head step (final norm, lm_head, sampling) is inside it, the rest is its own work and hand-offs.",
            unit="s",
        ),
        PromPanel(
            "Failovers and fallbacks per second (live)",
            (PromTarget("sum by (reason) (rate(hearth_failovers_total[1m]))", "failover {{reason}}"),
             PromTarget("sum(rate(hearth_fallback_to_local_total[1m]))", "fallback to local")),
        ),
    ),
)

SHARD_HOSTS = Dashboard(
    uid="hearth-shard-hosts",
    title="hearth / Shard hosts",
    description="Each host's speed, the tokens it served and what went wrong on it.",
    panels=(
        SqlPanel(
            "p95 step latency by shard (latest heartbeat)", "barchart", P95_STEP_OF_LIVE_SHARDS_SQL,
            ("shard", "p95_step_ms"), "Live shards only (the Mesh dashboard's Shards advertised).", unit="ms",
        ),
        SqlPanel(
            "Tokens through each host per day", "timeseries",
            """SELECT day AS time, node_id AS host, tokens FROM host_tokens_daily
WHERE day BETWEEN $__from / 1000 - 86399 AND $__to / 1000 ORDER BY 1, 2""",
            ("time", "host", "tokens"),
            "Prompt and generated tokens of completed calls per UTC day, on the hosts whose hops finished them: a "
            "call counts once on each such host, however many of its hops (shard processes, layer ranges) that "
            "host held; a failed-over host's part is counted on its replacement (host_tokens_daily). A host is the "
            "node its shards' ids name, so it stays under its name once the retention pruned their advertisements.",
            bars=True,
        ),
        SqlPanel(
            "Reputation: pipelines joined, failovers caused, corruption detected", "table",
            f"""SELECT COALESCE(shards.node_id, {node_of_shard_sql('shard_stats.shard_id')}) AS node,
       shard_stats.shard_id AS shard,
       shard_stats.tokens_served AS tokens_served, shard_stats.pipelines_joined AS pipelines_joined,
       shard_stats.failovers_caused AS failovers_caused,
       shard_stats.corruption_detections AS corruption_detections
FROM shard_stats LEFT JOIN shards ON shards.shard_id = shard_stats.shard_id
ORDER BY corruption_detections DESC, failovers_caused DESC, shard""",
            ("node", "shard", "failovers_caused", "corruption_detections"),
        ),
        SqlPanel(
            "Reputation: verified work, mismatches, quarantine", "table", REPUTATION_SQL,
            ("node", "shard", "status", "checks", "verified_positions", "mismatches", "disputes", "since"),
            "From the spot-checks' signed outcomes (shard_reputation): checks that found nothing wrong and the "
            "positions they verified; mismatches two other parties confirmed; disputes nobody could settle. A "
            "quarantined shard, and every other shard of its node, is never routed until a steward runs "
            "`hearth community clear-quarantine`; since: "
            "when its status last changed (UTC), reason: the evidence or the steward's reason.",
        ),
        PromPanel(
            "Step compute p95 by shard (live)",
            (PromTarget(histogram_p(0.95, "hearth_shard_step_compute_seconds", "shard_id"), "{{shard_id}}"),),
            unit="s",
        ),
        PromPanel(
            "Tokens served per minute by shard (live)",
            (PromTarget("sum by (shard_id) (rate(hearth_shard_tokens_served_total[1m])) * 60", "{{shard_id}}"),),
        ),
        PromPanel(
            "Corruption detections (live)",
            (PromTarget("sum by (shard_id, check) (increase(hearth_shard_corruption_detected_total[5m]))",
                        "{{shard_id}} {{check}}"),),
        ),
    ),
)

EVENT_LOG = Dashboard(
    uid="hearth-event-log",
    title="hearth / Event log",
    description="The event streams as the projector applies them: rates, lag, and every rejected event.",
    panels=(
        SqlPanel(
            "Events per minute by type", "timeseries",
            f"""SELECT minute AS time, type, events FROM event_counts
WHERE {in_range('minute')} ORDER BY minute, type""",
            ("time", "type", "events"), "Applied events, by the minute they occurred (event_counts). A member's "
            "removal or key rotation is published in both streams and applied in each, so it counts twice.",
            bars=True,
        ),
        SqlPanel(
            "Rejected events per minute by reason", "timeseries",
            f"""SELECT $__unixEpochGroupSeconds(minute, 60) AS time, reason, SUM(events) AS rejected
FROM rejected_event_counts WHERE {in_range('minute')} GROUP BY 1, 2 ORDER BY 1, 2""",
            ("time", "reason", "rejected"), "Events the projector refused (unsigned, unknown signer, ...), every one "
            "counted (rejected_event_counts).",
            bars=True,
        ),
        SqlPanel(
            "Latest rejected events", "table",
            f"""SELECT rejected_at AS time, reason, type, node_id AS claimed_node, COALESCE(signer, '') AS signer,
       stream, stream_seq
FROM rejected_events WHERE {in_range('rejected_at')} ORDER BY rejected_at DESC, stream_seq DESC LIMIT 50""",
            ("time", "reason", "type", "claimed_node"),
            "A sample: the first [readmodels] rejected_samples_per_minute of each reason in each minute of each "
            "stream (rejected_events); `hearth-replay verify` lists every one the log holds.",
        ),
        SqlPanel(
            "Projection positions", "table",
            f"""SELECT projection, stream, last_seq, {age_at_range_end('last_event_at')} AS newest_event_age_s
FROM projection_positions ORDER BY projection, stream""",
            ("stream", "last_seq", "newest_event_age_s"),
            "How far this read model has read each stream; the lag itself is the Prometheus panel beside. "
            "newest_event_age_s: seconds from when the stream stored the newest event read to the end of the time "
            "range; 0 when the read model has read past that end (a past range).",
        ),
        PromPanel(
            "Projector lag",
            (PromTarget("max(hearth_projector_lag_events)", "events behind"),
             PromTarget("max(hearth_projector_lag_seconds)", "seconds behind")),
        ),
        PromPanel(
            "Audit events waiting in orchestrator outboxes",
            (PromTarget("max by (instance) (hearth_event_outbox_depth)", "{{instance}}"),),
            "Events each orchestrator recorded (or found left by its previous run) and JetStream has not stored yet; "
            "kept in its outbox file meanwhile (`hearth docs operations`, \"The event outbox\"). One that stays above "
            "0: the broker is not taking its events, and calls wait once it reaches [orchestrator] event_queue_max.",
        ),
        PromPanel(
            "Events applied per second by type (live)",
            (PromTarget("sum by (event_type) (rate(hearth_projector_events_applied_total[1m]))", "{{event_type}}"),
             # max, not sum: every process that projects the log (the projector, each orchestrator's routing read
             # model) counts the same rejected event.
             PromTarget("max by (reason) (rate(hearth_events_rejected_total[1m]))", "rejected {{reason}}")),
            "Every process projecting the log counts the same rejected events: the rejected rate is the highest "
            "of theirs, not their sum.",
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (MESH, PIPELINES, SHARD_HOSTS, EVENT_LOG)
